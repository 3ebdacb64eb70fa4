//! Secrets as types: key material and passphrases live in [`SecretBytes`], a heap buffer that is
//! locked in RAM (`mlock`, best effort), excluded from core dumps (`MADV_DONTDUMP`), never
//! `Debug`-printed, not `Clone`, compared in constant time and zeroised on drop.
//!
//! The buffer is allocated page-aligned so that the `madvise`/`mlock` calls cover exactly the
//! pages that hold the secret and no unrelated heap data.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use subtle::ConstantTimeEq;
use zeroize::Zeroize;

// mlock/madvise round to pages anyway.
use crate::sync::PAGE_BYTES;

/// Largest secret we ever hold: a LUKS anti-forensic split of a 512-byte key is 4000 × 64 bytes
/// = 256 KiB; leave headroom for keyfiles (cryptsetup caps keyfiles at 8 MiB).
pub const SECRET_BYTES_MAX: usize = 8 << 20;

/// A fixed-length secret byte buffer. See the module documentation.
pub struct SecretBytes {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: SecretBytes owns its allocation exclusively (like a Box<[u8]>); no interior mutability.
unsafe impl Send for SecretBytes {}
// SAFETY: shared references only allow reads of the owned buffer.
unsafe impl Sync for SecretBytes {}

impl SecretBytes {
    /// A zero-filled secret of `len` bytes. Panics only if `len > SECRET_BYTES_MAX` (caller bug:
    /// every caller bounds its input first) or the allocator fails.
    pub fn zeroed(len: usize) -> Self {
        assert!(
            len <= SECRET_BYTES_MAX,
            "secret of {len} bytes exceeds SECRET_BYTES_MAX"
        );
        let cap = len.max(1).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let layout = Layout::from_size_align(cap, PAGE_BYTES).expect("page layout is valid");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: ptr..ptr+cap is our own, page-aligned allocation. Both calls are advisory: a
        // failure (RLIMIT_MEMLOCK reached, kernel without MADV_DONTDUMP) leaves a working buffer.
        unsafe {
            libc::madvise(raw.cast(), cap, libc::MADV_DONTDUMP);
            libc::mlock(raw.cast(), cap);
        }
        SecretBytes { ptr, len, cap }
    }

    /// Copies `bytes` into a new secret. The caller remains responsible for wiping the source.
    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut s = Self::zeroed(bytes.len());
        s.as_mut().copy_from_slice(bytes);
        s
    }

    /// Moves a vector into a secret and wipes the vector's buffer.
    pub fn from_vec(mut v: Vec<u8>) -> Self {
        let s = Self::from_slice(&v);
        v.zeroize();
        s
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Constant-time equality (length is not secret).
    pub fn ct_eq(&self, other: &[u8]) -> bool {
        self.len == other.len() && bool::from(self.as_ref().ct_eq(other))
    }

    /// A new secret holding `self[range]`.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        Self::from_slice(&self.as_ref()[range])
    }
}

impl AsRef<[u8]> for SecretBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised (zeroed) bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl AsMut<[u8]> for SecretBytes {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SecretBytes {
    fn drop(&mut self) {
        // SAFETY: ptr..ptr+cap is our allocation; zeroize's volatile writes are not elided.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap).zeroize();
            libc::munlock(self.ptr.as_ptr().cast(), self.cap);
            let layout =
                Layout::from_size_align(self.cap, PAGE_BYTES).expect("page layout is valid");
            dealloc(self.ptr.as_ptr(), layout);
        }
    }
}

impl std::fmt::Debug for SecretBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretBytes({} bytes, redacted)", self.len)
    }
}

/// A value kept in a [`SecretBytes`] allocation (locked, non-dumpable, wiped when dropped):
/// for keyed cipher states whose fields hold key material, such as key schedules and HMAC
/// pads. The value never moves once boxed. A value built on the stack and then boxed leaves a
/// transient stack copy; C states are better initialised in place ([`SecretBox::zeroed`]).
pub struct SecretBox<T> {
    mem: SecretBytes,
    _holds: std::marker::PhantomData<T>,
}

impl<T> SecretBox<T> {
    fn alloc() -> SecretBytes {
        // SecretBytes' allocation is page-aligned, which satisfies any alignment up to a page.
        assert!(
            std::mem::align_of::<T>() <= PAGE_BYTES,
            "SecretBox: over-aligned type"
        );
        SecretBytes::zeroed(std::mem::size_of::<T>())
    }

    pub fn new(value: T) -> Self {
        let mut mem = Self::alloc();
        // SAFETY: `mem` holds size_of::<T>() bytes (it rounds up, never down), page-aligned
        // and so aligned for T (asserted in `alloc`), owned by us and holding no value yet.
        unsafe { std::ptr::write(mem.as_mut().as_mut_ptr().cast::<T>(), value) };
        SecretBox {
            mem,
            _holds: std::marker::PhantomData,
        }
    }

    /// A box holding all-zero bytes as its value.
    ///
    /// # Safety
    /// The all-zero bit pattern must be a valid `T` (a plain C struct such as AWS-LC's
    /// `EVP_AEAD_CTX` after `EVP_AEAD_CTX_zero`).
    pub unsafe fn zeroed() -> Self {
        SecretBox {
            mem: Self::alloc(),
            _holds: std::marker::PhantomData,
        }
    }

    pub fn as_ptr(&self) -> *const T {
        self.mem.as_ref().as_ptr().cast()
    }

    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.mem.as_mut().as_mut_ptr().cast()
    }
}

impl<T> std::ops::Deref for SecretBox<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the allocation holds an initialised, aligned T for as long as `self` lives.
        unsafe { &*self.as_ptr() }
    }
}

impl<T> std::ops::DerefMut for SecretBox<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` gives exclusive access.
        unsafe { &mut *self.as_mut_ptr() }
    }
}

impl<T> Drop for SecretBox<T> {
    fn drop(&mut self) {
        // SAFETY: the value is initialised and dropped once, here; `mem` then wipes the bytes.
        unsafe { std::ptr::drop_in_place(self.as_mut_ptr()) };
    }
}

impl<T> std::fmt::Debug for SecretBox<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretBox({}, redacted)", std::any::type_name::<T>())
    }
}

/// Bytes of this thread's stack [`scrub_stack`] overwrites: far more than the calls beneath
/// an unlock use (PBKDF2 and HMAC frames, a keyslot's AES, the anti-forensic merge: a few
/// KiB), and small beside any thread's stack (2 MiB by default).
pub const STACK_SCRUB_BYTES: usize = 64 << 10;

/// Zeroes [`STACK_SCRUB_BYTES`] of this thread's stack below the caller's frame.
///
/// Hash, HMAC and PBKDF2 functions (RustCrypto) and AES (AWS-LC) leave copies of what they
/// were given in their stack frames when they return: the volume key as the HMAC key of a
/// digest check, a keyslot's derived key, pieces of the anti-forensic merge. Nothing wipes
/// those frames; they stay in memory until later calls happen to overwrite them (a suspended
/// daemon's core was seen to hold half of an XTS key this way). The LUKS code calls this when
/// it is done with a key, with the calls that touched it all beneath its own frame, so those
/// copies are gone before the function returns.
#[inline(never)]
pub fn scrub_stack() {
    let mut area = [0u8; STACK_SCRUB_BYTES];
    // Volatile writes: not elided although `area` is never read.
    area.zeroize();
    std::hint::black_box(&mut area);
}

/// Asks the kernel not to write this process's memory to core dumps at all (`PR_SET_DUMPABLE`
/// = 0). The CLI calls it at start-up when it will handle passphrases or keys.
pub fn disable_core_dumps() {
    // SAFETY: prctl with PR_SET_DUMPABLE takes an integer argument and touches no memory.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_prints_contents() {
        let s = SecretBytes::from_slice(b"hunter2");
        let d = format!("{s:?}");
        assert!(!d.contains("hunter2"));
        assert!(d.contains("7 bytes"));
    }

    #[test]
    fn ct_eq_matches_plain_equality() {
        let s = SecretBytes::from_slice(&[1, 2, 3]);
        assert!(s.ct_eq(&[1, 2, 3]));
        assert!(!s.ct_eq(&[1, 2, 4]));
        assert!(!s.ct_eq(&[1, 2]));
    }

    #[test]
    fn empty_secret_is_valid() {
        let s = SecretBytes::zeroed(0);
        assert!(s.is_empty());
        assert_eq!(s.as_ref(), &[] as &[u8]);
    }

    #[test]
    fn secret_box_holds_and_drops_its_value() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static DROPS: AtomicUsize = AtomicUsize::new(0);
        struct Keyed([u64; 100]);
        impl Drop for Keyed {
            fn drop(&mut self) {
                DROPS.fetch_add(1, Ordering::SeqCst);
            }
        }
        let mut b = SecretBox::new(Keyed([7; 100]));
        assert_eq!(b.0[99], 7);
        b.0[0] = 9;
        assert_eq!(b.0[0], 9);
        assert_eq!(b.as_ptr() as usize % PAGE_BYTES, 0);
        assert!(!format!("{b:?}").contains('9'));
        drop(b);
        assert_eq!(DROPS.load(Ordering::SeqCst), 1);
    }
}
