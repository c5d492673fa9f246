//! The picker as a child process — the real `cachepick serve` binary — so a run can SIGKILL it and
//! start it again on the same ports, and read its resident memory from `/proc/<pid>/status`.

use std::fs::OpenOptions;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::ChaosError;

/// `cachepick serve --config <file>`, restartable; killed when dropped.
pub struct ChildPicker {
    binary: PathBuf,
    config: PathBuf,
    log: PathBuf,
    listen: SocketAddr,
    child: Option<Child>,
    starts: u32,
}

impl ChildPicker {
    /// Starts `binary serve --config config` (whose `listen` is `listen`), its output appended to `log`.
    pub fn spawn(
        binary: &Path,
        config: &Path,
        listen: SocketAddr,
        log: &Path,
    ) -> Result<ChildPicker, ChaosError> {
        let mut picker = ChildPicker {
            binary: binary.to_owned(),
            config: config.to_owned(),
            log: log.to_owned(),
            listen,
            child: None,
            starts: 0,
        };
        picker.start()?;
        Ok(picker)
    }

    /// Starts a new process (the previous one must be gone).
    pub fn start(&mut self) -> Result<(), ChaosError> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|source| ChaosError::Write {
                path: self.log.clone(),
                source,
            })?;
        let err = log.try_clone().map_err(|source| ChaosError::Write {
            path: self.log.clone(),
            source,
        })?;
        let child = Command::new(&self.binary)
            .arg("serve")
            .arg("--config")
            .arg(&self.config)
            .env(
                "RUST_LOG",
                std::env::var("CACHEPICK_CHAOS_LOG").unwrap_or_else(|_| "warn".to_owned()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(err))
            .spawn()
            .map_err(|source| ChaosError::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        self.child = Some(child);
        self.starts += 1;
        Ok(())
    }

    /// Waits until the picker's gRPC readiness is SERVING; a process that exited meanwhile says so.
    pub async fn ready(&mut self, within: Duration) -> Result<(), ChaosError> {
        let waited = crate::client::wait_ready(self.listen, within).await;
        if let Some(child) = &mut self.child
            && let Ok(Some(status)) = child.try_wait()
        {
            return Err(ChaosError::PickerExited {
                status: status.to_string(),
                log: self.log.clone(),
            });
        }
        waited.map_err(|error| ChaosError::PickerNotReady(error.to_string()))
    }

    /// SIGKILL, and reap the process.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// How many processes have been started.
    pub fn starts(&self) -> u32 {
        self.starts
    }

    /// The process's resident set (`VmRSS`), KiB; `None` while there is no process.
    pub fn rss_kib(&self) -> Option<u64> {
        rss_kib(self.pid()?)
    }
}

impl Drop for ChildPicker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `VmRSS` of process `pid`, KiB, from `/proc/<pid>/status`.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_rss(&status)
}

fn parse_rss(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_is_read_in_kib() {
        let status = "Name:\tcachepick\nVmPeak:\t  99999 kB\nVmRSS:\t   23456 kB\nThreads:\t4\n";
        assert_eq!(parse_rss(status), Some(23_456));
        assert_eq!(parse_rss("Name:\tx\n"), None);
        assert!(rss_kib(std::process::id()).is_some_and(|kib| kib > 0));
    }
}
