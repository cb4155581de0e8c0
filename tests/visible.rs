//! Visible devices (`kiln::runtime::visible`, TensorFlow's `set_visible_devices`) on the
//! emulated CUDA device: hidden GPUs disappear from detection, `Device::best` and backends; the
//! choice is fixed once a GPU is in use; unknown and repeated names are errors; the device table
//! shows the process's host memory; `CUDA_VISIBLE_DEVICES` hides the emulated device as the
//! driver hides a GPU. One test: the visible devices are process-wide.

use kiln::prelude::*;
use kiln::runtime::cuda::{self, CudaBackend};
use kiln::runtime::visible::set_visible_devices;
use std::process::Command;

#[test]
fn visible_devices_hide_gpus_until_one_is_in_use() {
    if let Err(why) = cuda::emulator::host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the emulated device: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    cuda::emulate_in_process(GB);
    let e = set_visible_devices(&["gpu:7"]).unwrap_err().to_string();
    assert!(e.contains("no physical device `gpu:7`") && e.contains("gpu:0"), "{e}");
    let e = set_visible_devices(&["gpu:0", "gpu:0"]).unwrap_err().to_string();
    assert!(e.contains("named twice"), "{e}");

    // Every GPU hidden: detection, the best device and backends see only the CPU.
    set_visible_devices(&["cpu:0"]).unwrap();
    assert!(!DeviceConfig::detect().has_gpu());
    assert_eq!(Device::best().0, Device::Cpu, "{}", Device::best().1);
    let e = CudaBackend::new(0, 1).err().expect("a hidden GPU").to_string();
    assert!(e.contains("gpu:0 is not visible"), "{e}");

    // Shown again, used, then fixed.
    set_visible_devices(&["gpu:0"]).unwrap();
    let devices = DeviceConfig::detect().build().unwrap();
    assert!(devices.physical().iter().any(|p| p.name == "gpu:0"));
    assert_eq!(Device::best().0, Device::Cuda(0));
    let _in_use = CudaBackend::new(0, 1).unwrap();
    let e = set_visible_devices(&[]).unwrap_err().to_string();
    assert!(e.contains("cannot be changed after gpu:0 is in use"), "{e}");
    set_visible_devices(&["gpu:0"]).expect("the same choice again is no change");
    let table = devices.table();
    assert!(table.contains("visible GPUs: gpu:0") && table.contains("resident on the host"), "{table}");

    // CUDA_VISIBLE_DEVICES, one level below: the emulated device is ordinal 0.
    // `KILN_BIN`: the binary where it was carried to (a bundle run on another machine).
    let kiln = std::env::var("KILN_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kiln").to_string());
    let listed = |visible: &str| {
        let out = Command::new(&kiln)
            .arg("devices")
            .env("KILN_CUDA_EMULATE", "1")
            .env("CUDA_VISIBLE_DEVICES", visible)
            .output()
            .expect("kiln runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).contains("  gpu:0 ")
    };
    assert!(listed("0"), "CUDA_VISIBLE_DEVICES=0 shows the device");
    assert!(!listed("1"), "CUDA_VISIBLE_DEVICES=1 hides it");
    assert!(!listed(""), "an empty CUDA_VISIBLE_DEVICES hides it");
    assert!(listed("0,1"));
}
