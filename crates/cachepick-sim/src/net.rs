//! Binding the simulator's listeners.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket};

/// A listener on `addr` (port 0 takes a free one) with an accept queue of `backlog`, and
/// `SO_REUSEADDR`, so a restarted worker binds its ports again while the dead one's connections
/// linger in TIME_WAIT.
pub(crate) fn bind_reusable(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}
