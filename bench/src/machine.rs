//! The machine a report was measured on: CPU model, CPUs, memory, kernel, and whether it is a
//! virtual machine (and which), read from `/proc` and `/sys` so a report says where its figures
//! come from.

use serde::{Deserialize, Serialize};

/// Where a report was measured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// The CPU's model name (`/proc/cpuinfo`), or `unknown CPU`.
    pub cpu: String,
    /// Online CPUs of the machine (not only those this process may use).
    pub cpus: usize,
    /// Total memory, MiB (`/proc/meminfo`), 0 when unknown.
    pub memory_mib: u64,
    /// Kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel: String,
    /// The hypervisor or emulator it runs under (`QEMU`, `KVM`, ...), `None` on bare metal or
    /// when nothing says so.
    pub virtualization: Option<String>,
}

impl Machine {
    /// This machine.
    pub fn here() -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        Machine::parse(
            &read("/proc/cpuinfo"),
            &read("/proc/meminfo"),
            read("/proc/sys/kernel/osrelease").trim(),
            read("/sys/class/dmi/id/sys_vendor").trim(),
            read("/sys/class/dmi/id/product_name").trim(),
        )
    }

    /// The machine described by these files' contents (testable without the files).
    fn parse(
        cpuinfo: &str,
        meminfo: &str,
        kernel: &str,
        dmi_vendor: &str,
        dmi_product: &str,
    ) -> Machine {
        let field = |line: &str, name: &str| -> Option<String> {
            let (k, v) = line.split_once(':')?;
            (k.trim() == name).then(|| v.trim().to_string())
        };
        let cpu = cpuinfo
            .lines()
            .find_map(|l| field(l, "model name"))
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| "unknown CPU".into());
        let cpus = cpuinfo
            .lines()
            .filter(|l| field(l, "processor").is_some())
            .count()
            .max(1);
        let memory_mib = meminfo
            .lines()
            .find_map(|l| field(l, "MemTotal"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib / 1024);
        let hypervisor_flag = cpuinfo
            .lines()
            .find_map(|l| field(l, "flags"))
            .is_some_and(|f| f.split_whitespace().any(|x| x == "hypervisor"));
        let dmi = [dmi_vendor, dmi_product]
            .into_iter()
            .filter(|s| !s.is_empty() && !s.eq_ignore_ascii_case("none"))
            .collect::<Vec<_>>()
            .join(" ");
        let known = [
            "QEMU",
            "KVM",
            "VMware",
            "VirtualBox",
            "Xen",
            "Google",
            "Amazon",
        ]
        .into_iter()
        .any(|k| dmi.contains(k));
        let virtualization = if known || (hypervisor_flag && !dmi.is_empty()) {
            Some(dmi)
        } else if hypervisor_flag || cpu.contains("QEMU") {
            Some("unnamed hypervisor".into())
        } else {
            None
        };
        Machine {
            cpu,
            cpus,
            memory_mib,
            kernel: if kernel.is_empty() {
                "unknown kernel".into()
            } else {
                kernel.into()
            },
            virtualization,
        }
    }

    /// One line: `Intel Xeon ... x 2 CPUs, 23.5 GiB, Linux 6.1.0, virtual machine (QEMU)`.
    pub fn summary(&self) -> String {
        let memory = if self.memory_mib == 0 {
            String::new()
        } else {
            format!(", {:.1} GiB", self.memory_mib as f64 / 1024.0)
        };
        let virt = match &self.virtualization {
            Some(v) => format!(", virtual machine ({v})"),
            None => ", bare metal".into(),
        };
        format!(
            "{} x {} CPU{}{memory}, Linux {}{virt}",
            self.cpu,
            self.cpus,
            if self.cpus == 1 { "" } else { "s" },
            self.kernel
        )
    }
}

#[cfg(test)]
mod tests {
    use super::Machine;

    const CPUINFO: &str = "processor\t: 0\nmodel name\t: Test CPU @ 2.0GHz\nflags\t\t: fpu hypervisor sse\n\n\
                           processor\t: 1\nmodel name\t: Test CPU @ 2.0GHz\nflags\t\t: fpu hypervisor sse\n";

    #[test]
    fn a_virtual_machine_is_named_from_its_dmi_strings() {
        let m = Machine::parse(
            CPUINFO,
            "MemTotal:  2097152 kB\n",
            "6.1.0-9",
            "QEMU",
            "Standard PC",
        );
        assert_eq!(m.cpu, "Test CPU @ 2.0GHz");
        assert_eq!(m.cpus, 2);
        assert_eq!(m.memory_mib, 2048);
        assert_eq!(m.virtualization.as_deref(), Some("QEMU Standard PC"));
        assert_eq!(
            m.summary(),
            "Test CPU @ 2.0GHz x 2 CPUs, 2.0 GiB, Linux 6.1.0-9, virtual machine (QEMU Standard PC)"
        );
    }

    #[test]
    fn bare_metal_says_so_and_missing_files_do_not_fail() {
        let m = Machine::parse(
            "processor : 0\nmodel name : Metal\nflags : fpu\n",
            "",
            "6.12",
            "Dell Inc.",
            "PowerEdge",
        );
        assert_eq!(m.virtualization, None);
        assert!(
            m.summary().ends_with("Linux 6.12, bare metal"),
            "{}",
            m.summary()
        );
        let empty = Machine::parse("", "", "", "", "");
        assert_eq!(empty.cpu, "unknown CPU");
        assert_eq!(empty.cpus, 1);
        assert_eq!(empty.kernel, "unknown kernel");
    }

    #[test]
    fn a_hypervisor_flag_without_dmi_is_still_a_virtual_machine() {
        let m = Machine::parse(CPUINFO, "", "6.1", "", "");
        assert_eq!(m.virtualization.as_deref(), Some("unnamed hypervisor"));
    }
}
