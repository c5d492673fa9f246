#!/usr/bin/env python3
"""Slowloris against a running `cachepick serve`, to show what the metrics listener's bounds hold.

Opens N connections to metrics_listen that send the start of a request and then trickle header lines
without ever ending them, and reports the serve process's open file descriptors before, one second
into and seven seconds into the attack (past the default 5 s header_read_timeout), whether the ext_proc
listener still answers an HTTP/2 preface during the attack, and cachepick's own counts afterwards.

    cachepick sim --engine vllm --workers 2 --emit-config /tmp/cp.yaml &
    (ulimit -n 1024; cachepick serve --config /tmp/cp.yaml --listen 127.0.0.1:19002 \\
        --metrics-listen 127.0.0.1:19090 & echo $! > /tmp/serve.pid)
    python3 scripts/slowloris-probe.py $(cat /tmp/serve.pid) 19090 2000 19002

Linux only (reads /proc/PID/fd); standard library only; raises its own descriptor limit for the
attacking sockets.
"""

import os
import resource
import socket
import sys
import time
import urllib.request


def main() -> None:
    pid, port, count, grpc_port = (int(arg) for arg in sys.argv[1:5])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 256), hard))

    def fds() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    limit = next(
        line.split()[3] for line in open(f"/proc/{pid}/limits") if line.startswith("Max open files")
    )
    print(f"serve pid {pid}: ulimit -n {limit}; open fds before the attack: {fds()}")
    sockets, failed = [], 0
    for _ in range(count):
        sock = socket.socket()
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: cachepick\r\n")
        except OSError:
            failed += 1
        sockets.append(sock)
    time.sleep(1.0)
    peak = fds()
    grpc = socket.create_connection(("127.0.0.1", grpc_port), timeout=2)
    # The HTTP/2 client preface and an empty SETTINGS frame; a gRPC server answers with its SETTINGS.
    grpc.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    answer = grpc.recv(64)
    settings = len(answer) > 3 and answer[3] == 4
    print(
        f"{count} slow connections opened ({failed} failed to connect); open fds 1 s into the attack: "
        f"{peak}; the ext_proc listener answered the HTTP/2 preface with SETTINGS: {settings}"
    )
    started = time.time()
    while time.time() - started < 7:
        for sock in sockets:
            try:
                sock.send(b"X-Slow: a\r\n")
            except OSError:
                pass
        time.sleep(0.5)
    print(f"open fds 7 s into the attack, still trickling: {fds()}")
    for sock in sockets:
        sock.close()
    time.sleep(0.5)
    print(f"open fds after: {fds()}")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("cachepick_metrics_http"):
                print(line)


if __name__ == "__main__":
    main()
