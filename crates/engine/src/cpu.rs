//! The CPUs the engine may run on, and pinning a thread to one of them.
#![allow(unsafe_code)]

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; zeroed is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: sched_getaffinity fills `set`, whose size we pass.
    let rc = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return vec![0];
    }
    // SAFETY: CPU_ISSET reads the set filled above.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// Pins the calling thread to one CPU.
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        let e = format!("CPU {cpu} is out of range: CPUs are numbered below {}", libc::CPU_SETSIZE);
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e));
    }
    // SAFETY: as above, a zeroed cpu_set_t is empty.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t and cpu < CPU_SETSIZE was checked above, so
    // CPU_SET writes inside it.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: sched_setaffinity reads `set`, whose size we pass.
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// The CPU each reactor of `cfg` runs on (`None`: not pinned): its `cores`, checked
/// against the CPUs this process may use, or the first `reactors` of those.
pub fn reactor_cpus(cfg: &crate::config::EngineConfig) -> Result<Vec<Option<usize>>, String> {
    let allowed = allowed_cpus();
    if let Some(cores) = &cfg.cores {
        if let Some(bad) = cores.iter().find(|c| !allowed.contains(c)) {
            return Err(format!(
                "cores: CPU {bad} is not one this process may run on; use some of {}",
                allowed.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
            ));
        }
        return Ok(cores.iter().map(|&c| Some(c)).collect());
    }
    Ok((0..cfg.reactors.unwrap_or(1)).map(|i| allowed.get(i).copied()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EngineConfig;

    #[test]
    fn reactor_cpus_must_exist() {
        let cfg = EngineConfig::from_toml("cores = [5000]").unwrap();
        let e = reactor_cpus(&cfg).unwrap_err();
        assert!(e.contains("CPU 5000") && e.contains("use some of"), "{e}");
        let first = allowed_cpus()[0];
        let cfg = EngineConfig::from_toml(&format!("cores = [{first}]")).unwrap();
        assert_eq!(reactor_cpus(&cfg).unwrap(), vec![Some(first)]);
        assert!(pin_current_thread(100_000).is_err(), "an error, not a panic");
    }
}
