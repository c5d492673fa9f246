# syntax=docker/dockerfile:1.7
# cachepick's container image: the `cachepick` binary (crates/cachepick-cli) on a distroless base, run
# as a non-root user. Build from the repository root (BuildKit is required for the cache mounts, the
# default builder since Docker 23):
#
#   docker build -t cachepick:dev .
#
# The toolchain is pinned by rust-toolchain.toml; RUST_VERSION must name the same release.
ARG RUST_VERSION=1.95.0

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
# The whole workspace: the product's build script compiles proto/ (with protox, so no system protoc),
# and Cargo loads every member's manifest. .dockerignore keeps target/ and .git out.
COPY . .
# Dependency caching: the registry, git checkouts and target/ live in BuildKit cache mounts, so a
# rebuild after a source change recompiles only the workspace's own crates. The binary is copied out of
# the cache mount, which does not persist into the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p cachepick-cli \
    && install -D -m 0755 target/release/cachepick /out/cachepick

# glibc and libgcc, nothing else: no shell, no package manager. `nonroot` is uid/gid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /out/cachepick /cachepick
USER 65532:65532
# 9002: gRPC (ext_proc, EDS, health; HTTP/2 only). 9090: Prometheus /metrics.
EXPOSE 9002 9090
ENTRYPOINT ["/cachepick"]
CMD ["serve", "--config", "/etc/cachepick/cachepick.yaml"]
