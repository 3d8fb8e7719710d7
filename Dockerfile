# syntax=docker/dockerfile:1
# memguard image: memguard-webhook, memguard-sidecar and memguard in one minimal, non-root image.
#
#   docker build -t ghcr.io/memguard/memguard:0.1.0 .
#
# The runtime is distroless/cc (glibc), not a static musl binary: the sidecar loads NVIDIA's
# libnvidia-ml.so at run time (the `nvml` feature), and a static musl binary cannot dlopen a glibc
# library. Everything else the binaries need (rustls, ring) is linked in.

# The toolchain CI tests with (the MSRV in Cargo.toml is a floor, not what we ship).
ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p memguard-webhook -p memguard \
    && cargo build --profile sidecar --locked -p memguard-sidecar \
    && mkdir -p /out \
    && cp target/release/memguard-webhook target/sidecar/memguard-sidecar target/release/memguard /out/

FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.source="https://github.com/memguard/memguard" \
      org.opencontainers.image.description="memguard: admission webhook, sidecar and CLI against OOM in ML training" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/ /usr/local/bin/
# distroless' nonroot user; the chart and the injected sidecar also set runAsUser 65532.
USER 65532:65532
# One image, three binaries: the chart runs /usr/local/bin/memguard-webhook, the webhook injects
# /usr/local/bin/memguard-sidecar. The default is the CLI.
ENTRYPOINT ["/usr/local/bin/memguard"]
CMD ["--help"]
