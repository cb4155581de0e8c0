//! Reports a kernel's access to a guard page: a SIGSEGV while an emulated kernel runs is an
//! access outside every allocation. The handler writes the kernel's name and the address to
//! stderr (with async-signal-safe calls only) and lets the fault kill the process, since a
//! kernel cannot be resumed past a bad access; a SIGSEGV outside a launch goes to the handler
//! that was installed before (Rust's stack-overflow report).

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

const NAME_CAP: usize = 200;
static RUNNING: AtomicBool = AtomicBool::new(false);
static NAME: [AtomicU8; NAME_CAP] = [const { AtomicU8::new(0) }; NAME_CAP];
static NAME_LEN: AtomicUsize = AtomicUsize::new(0);
static mut PREVIOUS: Option<libc::sigaction> = None;
static INSTALL: Once = Once::new();

/// Marks a kernel as running for the handler; launches are serialised, so one at a time.
pub struct Running;

impl Running {
    pub fn new(name: &str) -> Self {
        let bytes = name.as_bytes();
        let n = bytes.len().min(NAME_CAP);
        for (slot, &b) in NAME.iter().zip(&bytes[..n]) {
            slot.store(b, Ordering::Relaxed);
        }
        NAME_LEN.store(n, Ordering::Relaxed);
        RUNNING.store(true, Ordering::SeqCst);
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.store(false, Ordering::SeqCst);
    }
}

fn write_stderr(bytes: &[u8]) {
    // SAFETY: write(2) on a valid buffer is async-signal-safe.
    unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
}

extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    if RUNNING.load(Ordering::SeqCst) {
        let mut name = [0u8; NAME_CAP];
        let n = NAME_LEN.load(Ordering::Relaxed).min(NAME_CAP);
        for (b, slot) in name.iter_mut().zip(&NAME) {
            *b = slot.load(Ordering::Relaxed);
        }
        // SAFETY: the kernel delivered a SIGSEGV with its siginfo.
        let addr = unsafe { (*info).si_addr() } as usize;
        let mut hex = [0u8; 18];
        hex[0] = b'0';
        hex[1] = b'x';
        for (i, h) in hex[2..].iter_mut().enumerate() {
            *h = b"0123456789abcdef"[(addr >> (60 - 4 * i)) & 15];
        }
        write_stderr(b"\nkiln emulated CUDA device: kernel `");
        write_stderr(&name[..n]);
        write_stderr(b"` accessed ");
        write_stderr(&hex);
        write_stderr(b", outside every allocation (a guard page); the process stops here\n");
        // SAFETY: restoring the default action is async-signal-safe; returning re-runs the
        // faulting access, which now ends the process.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
        return;
    }
    // SAFETY: PREVIOUS is written once before the handler is installed and never after.
    let previous = unsafe { (*std::ptr::addr_of!(PREVIOUS)).as_ref() };
    match previous {
        // SAFETY: reinstalling the previous action; returning re-runs the access under it.
        Some(p) => unsafe {
            libc::sigaction(sig, p, std::ptr::null_mut());
        },
        // SAFETY: as above, with the default action.
        None => unsafe {
            libc::signal(sig, libc::SIG_DFL);
        },
    }
}

/// Installs the handler once per process.
pub fn install() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid starting value; the old action is saved before
        // the new one takes effect, and PREVIOUS is not written again.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = handler as *const () as usize;
            new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut new.sa_mask);
            if libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut old) == 0 {
                *std::ptr::addr_of_mut!(PREVIOUS) = Some(old);
                libc::sigaction(libc::SIGSEGV, &new, std::ptr::null_mut());
            }
        }
    });
}
