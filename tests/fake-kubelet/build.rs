//! Compiles the kubelet device-plugin API from sandbox-dp's copy, for the fake kubelet.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = "../../sandbox-dp/proto";
    let proto = "../../sandbox-dp/proto/api.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], [dir])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
