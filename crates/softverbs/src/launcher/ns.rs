//! Mount-namespace plumbing for the launcher.

use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::{os, LaunchError};

fn c(p: &Path) -> Result<CString, LaunchError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| LaunchError::Os {
        what: format!("path {}", p.display()),
        err: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })
}

fn mount(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), LaunchError> {
    let s = src.map(|x| CString::new(x).unwrap_or_default());
    let t = c(target)?;
    let f = fstype.map(|x| CString::new(x).unwrap_or_default());
    let d = data.map(|x| CString::new(x).unwrap_or_default());
    let p = |o: &Option<CString>| o.as_ref().map_or(std::ptr::null(), |x| x.as_ptr());
    // SAFETY: all pointers are null or valid C strings alive for the call.
    let r = unsafe { libc::mount(p(&s), t.as_ptr(), p(&f), flags, p(&d).cast()) };
    if r != 0 {
        return Err(LaunchError::Os {
            what: format!(
                "mount {} on {}",
                src.or(fstype).unwrap_or("-"),
                target.display()
            ),
            err: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Step 2: a private mount namespace.
///
/// # Errors
/// [`LaunchError::Os`].
pub fn enter_private_namespace() -> Result<(), LaunchError> {
    // SAFETY: unshare(CLONE_NEWNS) affects only this (single-threaded) process.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(LaunchError::Os {
            what: "unshare(CLONE_NEWNS)".into(),
            err: std::io::Error::last_os_error(),
        });
    }
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
}

/// Step 3: the staging tmpfs.
///
/// # Errors
/// [`LaunchError::Os`].
pub fn mount_stage(stage: &Path) -> Result<(), LaunchError> {
    std::fs::create_dir_all(stage).map_err(os(format!("creating {}", stage.display())))?;
    mount(
        Some("softverbs"),
        stage,
        Some("tmpfs"),
        0,
        Some("mode=0755,size=64m"),
    )
}

fn is_mountpoint(p: &Path) -> bool {
    let Ok(m) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = p.as_os_str().as_bytes();
    m.lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|mp| mp.as_bytes() == want))
}

/// Step 4: overlay /dev and add the uverbs node.
///
/// # Errors
/// [`LaunchError::Os`].
pub fn overlay_dev(stage: &Path) -> Result<(), LaunchError> {
    let upper = stage.join("dev-upper");
    let work = stage.join("dev-work");
    let keep = stage.join("dev-keep");
    for d in [&upper, &work, &keep] {
        std::fs::create_dir_all(d).map_err(os(format!("creating {}", d.display())))?;
    }
    let subs: Vec<&str> = ["shm", "pts", "mqueue", "hugepages"]
        .into_iter()
        .filter(|s| is_mountpoint(&Path::new("/dev").join(s)))
        .collect();
    for s in &subs {
        let k = keep.join(s);
        std::fs::create_dir_all(&k).map_err(os(format!("creating {}", k.display())))?;
        mount(
            Some(&format!("/dev/{s}")),
            &k,
            None,
            libc::MS_BIND | libc::MS_REC,
            None,
        )?;
    }
    let opts = format!(
        "lowerdir=/dev,upperdir={},workdir={}",
        upper.display(),
        work.display()
    );
    mount(
        Some("overlay"),
        Path::new("/dev"),
        Some("overlay"),
        0,
        Some(&opts),
    )?;
    for s in &subs {
        mount(
            Some(&keep.join(s).to_string_lossy()),
            &Path::new("/dev").join(s),
            None,
            libc::MS_MOVE,
            None,
        )?;
    }
    std::fs::create_dir_all("/dev/infiniband")
        .map_err(os("creating /dev/infiniband in the overlay"))?;
    let node = Path::new("/dev/infiniband/uverbs0");
    if !node.exists() {
        std::os::unix::fs::symlink("/dev/full", node)
            .map_err(os("linking /dev/infiniband/uverbs0"))?;
    }
    // librdmacm opens this node; the preloaded provider answers the open
    // itself (`crate::cm`). The link gives a program that bypasses it a
    // character device whose writes fail (ENOSPC), not a hang.
    let cm = Path::new("/dev/infiniband/rdma_cm");
    if !cm.exists() {
        std::os::unix::fs::symlink("/dev/full", cm)
            .map_err(os("linking /dev/infiniband/rdma_cm"))?;
    }
    Ok(())
}

/// Step 5: exec with the extra environment.
///
/// # Errors
/// [`LaunchError::Os`] when exec fails.
pub fn exec(
    args: &[OsString],
    env: &[(&str, OsString)],
) -> Result<std::convert::Infallible, LaunchError> {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(&args[0]);
    cmd.args(&args[1..]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let err = cmd.exec();
    Err(LaunchError::Os {
        what: format!("exec {}", args[0].to_string_lossy()),
        err,
    })
}

/// Step 4b: `/sys/class` with the device in it. Tools that look for an
/// RDMA device's network interface in the real sysfs
/// (`/sys/class/infiniband/<dev>/device/net/`, e.g. rdma-core's test
/// suite before it runs rdma_cm traffic) find it there. A tmpfs holding
/// the same class directories with the same (relative) links replaces
/// `/sys/class` in the namespace, plus `infiniband/softverbs0` linked to
/// the staged tree; every other link resolves into `/sys/devices` as
/// before.
///
/// # Errors
/// [`LaunchError::Os`].
pub fn shadow_sys_class(stage: &Path, device: &str) -> Result<(), LaunchError> {
    let shadow = stage.join("sys-class");
    std::fs::create_dir_all(&shadow).map_err(os(format!("creating {}", shadow.display())))?;
    let classes = std::fs::read_dir("/sys/class").map_err(os("reading /sys/class"))?;
    for class in classes.flatten() {
        let dir = shadow.join(class.file_name());
        std::fs::create_dir_all(&dir).map_err(os(format!("creating {}", dir.display())))?;
        let Ok(entries) = std::fs::read_dir(class.path()) else {
            continue;
        };
        for e in entries.flatten() {
            if let Ok(target) = std::fs::read_link(e.path()) {
                std::os::unix::fs::symlink(&target, dir.join(e.file_name()))
                    .map_err(os(format!("linking {}", e.path().display())))?;
            }
        }
    }
    let ib = shadow.join("infiniband");
    std::fs::create_dir_all(&ib).map_err(os("creating the infiniband class"))?;
    let link = ib.join(device);
    if !link.exists() {
        std::os::unix::fs::symlink(stage.join("sys/class/infiniband").join(device), &link)
            .map_err(os("linking the device into /sys/class/infiniband"))?;
    }
    mount(
        Some(&shadow.to_string_lossy()),
        Path::new("/sys/class"),
        None,
        libc::MS_BIND,
        None,
    )
}
