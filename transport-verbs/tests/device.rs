//! Device discovery against whatever the machine has.
//!
//! With `TRANSPORT_VERBS_REQUIRE_DEVICE=1` (set by `cargo xtask testbed verbs` in the soft-RoCE
//! guest, or by hand on a host with an RDMA NIC or an `rdma_rxe` device) the device (`$TB_DEV`,
//! else the first) must open, have an ACTIVE port and, on RoCE, a RoCE v2 IPv4 GID, answer the
//! capability probe, and accept a protection domain and a 64 KiB memory registration. Without
//! it, on a host with no RDMA, listing and opening must fail with the typed "no RDMA device"
//! error (and the test says it ran in no-device mode).

use transport_verbs::{
    list_devices, open_device, open_first_device, probe_devices, LinkLayer, RdmaTransport,
    VerbsError,
};

fn device_required() -> bool {
    std::env::var("TRANSPORT_VERBS_REQUIRE_DEVICE").is_ok_and(|v| v == "1")
}

/// The full check against a real (or soft-RoCE) device.
fn check_device() {
    let devices = list_devices().expect("listing RDMA devices");
    assert!(
        !devices.is_empty(),
        "list_devices returned Ok with no device"
    );
    for d in &devices {
        println!("device {}: ports {:?}", d.name, d.ports);
        for g in &d.gids {
            println!(
                "  gid port {} index {} {} {:?}",
                g.port_num, g.index, g.gid, g.gid_type
            );
        }
    }

    // The device under test: `$TB_DEV` (the test bed names its target), else the first.
    let dev = match std::env::var("TB_DEV") {
        Ok(name) => open_device(&name).unwrap_or_else(|e| panic!("opening {name}: {e}")),
        Err(_) => open_first_device().expect("opening the first RDMA device"),
    };
    let info = dev.info().expect("querying the device");
    assert_eq!(info.name, dev.name());
    let port = info
        .active_port()
        .unwrap_or_else(|| panic!("no ACTIVE port on {}: {:?}", info.name, info.ports));
    assert!(port.active_mtu.is_some(), "unknown active MTU: {port:?}");
    let caps = probe_devices()
        .expect("probing the devices")
        .into_iter()
        .find(|c| c.device == info.name)
        .expect("the device is among the probed");
    println!("{caps}");
    // RoCE needs an IPv4 RoCE v2 GID for rdma_cm; iWARP addresses by IP without GIDs.
    if port.link_layer == LinkLayer::Ethernet && caps.transport == RdmaTransport::Roce {
        let gid = info
            .roce_v2_ipv4_gid()
            .unwrap_or_else(|| panic!("no RoCE v2 IPv4 GID on {}: {:?}", info.name, info.gids));
        println!(
            "{}: RoCE v2 IPv4 GID at index {} ({})",
            info.name,
            gid.index,
            gid.ipv4().expect("IPv4-mapped")
        );
    }

    let pd = dev.alloc_pd().expect("allocating a protection domain");
    let mut buf = pd.register(64 * 1024).expect("registering 64 KiB");
    assert_eq!(buf.len(), 64 * 1024);
    assert_ne!(buf.lkey(), 0, "lkey 0 is never handed out for a user MR");
    buf.as_mut_slice()[..5].copy_from_slice(b"verbs");
    assert_eq!(&buf.as_slice()[..5], b"verbs");
    println!(
        "transport-verbs device test: opened {} (port {} ACTIVE, MTU {:?}), PD + 64 KiB MR lkey={:#x} rkey={:#x}",
        info.name,
        port.port_num,
        port.active_mtu,
        buf.lkey(),
        buf.rkey()
    );
}

#[test]
fn device_opens_or_reports_no_device() {
    if device_required() {
        check_device();
        return;
    }
    match list_devices() {
        Ok(devices) => {
            // A host with RDMA that did not ask for it: check the device all the same.
            println!(
                "found {} RDMA device(s) without TRANSPORT_VERBS_REQUIRE_DEVICE; checking them",
                devices.len()
            );
            check_device();
        }
        Err(e) => {
            assert!(
                e.is_no_device(),
                "expected the typed no-device error, got: {e:?}"
            );
            assert!(
                e.to_string()
                    .starts_with("no RDMA device found; see README for soft-RoCE"),
                "unclear message: {e}"
            );
            let open = open_first_device().expect_err("open must fail like list did");
            assert!(
                matches!(open, VerbsError::NoDevice | VerbsError::RdmaCoreMissing),
                "open_first_device: {open:?}"
            );
            println!(
                "transport-verbs device tests ran in no-device mode ({e}); \
                 run `cargo xtask testbed verbs` for the soft-RoCE device tests"
            );
        }
    }
}
