//! Builds the preload hook library (`rust/preload/cumem_rs_preload.c`) into `$OUT_DIR`, for the extension to
//! embed (`include_bytes!` in `rust/src/preload.rs`) and write out for `LD_PRELOAD`.
//!
//! The `cc` crate only finds the C compiler (honouring `CC`/`CC_<target>`, as the wheel build's zig sets them);
//! the shared library is linked here, since `cc` itself builds static archives.

use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "rust/preload/cumem_rs_preload.c";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let lib = out.join("libcumem_rs_preload.so");
    let compiler = cc::Build::new()
        .opt_level(2)
        .pic(true)
        .cargo_metadata(false)
        .get_compiler();
    let mut cmd: Command = compiler.to_command();
    cmd.args([
        "-std=c99", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-o",
    ])
    .arg(&lib)
    .arg(SOURCE)
    // dlsym lives in libdl on the glibc 2.17 the wheel targets (in libc itself from 2.34 on).
    .arg("-ldl");
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cmd:?}: {e}"));
    assert!(
        status.success(),
        "building the preload library failed: {cmd:?}"
    );
}
