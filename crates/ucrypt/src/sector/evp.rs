//! The only module that calls into AWS-LC. A safe wrapper around one `EVP_CIPHER_CTX`, keyed
//! once; callers reset only the IV per data unit (re-keying costs 1-2 µs, an IV reset ~40 ns).
//!
//! Contract: an [`EvpCtx`] is used by one thread at a time (`Send`, not `Sync`); in-place
//! operation (`input == output`) is allowed by AWS-LC for ECB, CBC and XTS.

use std::os::raw::c_int;
use std::ptr;

use aws_lc_sys as sys;

use crate::{Error, Result};

/// The AWS-LC algorithms ucrypt uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Alg {
    Aes256Xts,
    AesEcb,
    AesCbc,
}

pub(crate) struct EvpCtx {
    ctx: *mut sys::EVP_CIPHER_CTX,
}

// SAFETY: an EVP_CIPHER_CTX has no thread affinity; it may move between threads as long as it is
// not used from two at once, which `&mut self` on every use guarantees (the type is not Sync).
unsafe impl Send for EvpCtx {}

fn check(rc: c_int, call: &'static str) -> Result<()> {
    if rc == 1 {
        Ok(())
    } else {
        // SAFETY: clears this thread's AWS-LC error queue; no pointers involved.
        unsafe { sys::ERR_clear_error() };
        Err(Error::CipherLibrary { call })
    }
}

impl EvpCtx {
    /// Keys a context for `alg` in direction `encrypt`. The key schedule is copied into the
    /// context; the caller may wipe `key` afterwards.
    pub(crate) fn new(alg: Alg, key: &[u8], encrypt: bool) -> Result<Self> {
        // SAFETY: the EVP_* getters return pointers to static cipher tables.
        let cipher = unsafe {
            match (alg, key.len()) {
                (Alg::Aes256Xts, 64) => sys::EVP_aes_256_xts(),
                (Alg::AesEcb, 16) => sys::EVP_aes_128_ecb(),
                (Alg::AesEcb, 24) => sys::EVP_aes_192_ecb(),
                (Alg::AesEcb, 32) => sys::EVP_aes_256_ecb(),
                (Alg::AesCbc, 16) => sys::EVP_aes_128_cbc(),
                (Alg::AesCbc, 24) => sys::EVP_aes_192_cbc(),
                (Alg::AesCbc, 32) => sys::EVP_aes_256_cbc(),
                _ => {
                    return Err(Error::Bug(
                        "EvpCtx::new called with a key size the spec rejects",
                    ))
                }
            }
        };
        // SAFETY: allocation call, checked for NULL below.
        let ctx = unsafe { sys::EVP_CIPHER_CTX_new() };
        if ctx.is_null() {
            return Err(Error::CipherLibrary {
                call: "EVP_CIPHER_CTX_new",
            });
        }
        let this = EvpCtx { ctx };
        let zero_iv = [0u8; 16];
        // SAFETY: ctx is valid; key.len() equals the cipher's key length (checked by the match
        // above); the IV buffer is 16 bytes, the IV length of every cipher above (ECB ignores it).
        let rc = unsafe {
            sys::EVP_CipherInit_ex(
                this.ctx,
                cipher,
                ptr::null_mut(),
                key.as_ptr(),
                zero_iv.as_ptr(),
                encrypt as c_int,
            )
        };
        check(rc, "EVP_CipherInit_ex")?;
        // SAFETY: ctx is initialised. Sectors are whole blocks, so padding must be off.
        let rc = unsafe { sys::EVP_CIPHER_CTX_set_padding(this.ctx, 0) };
        check(rc, "EVP_CIPHER_CTX_set_padding")?;
        Ok(this)
    }

    /// Sets a new 16-byte IV (XTS tweak) without re-keying.
    #[inline]
    pub(crate) fn set_iv(&mut self, iv: &[u8; 16]) -> Result<()> {
        // SAFETY: ctx is initialised with a cipher whose IV length is 16 (or ignored, for ECB);
        // NULL cipher and key keep the existing key schedule; -1 keeps the direction.
        let rc = unsafe {
            sys::EVP_CipherInit_ex(
                self.ctx,
                ptr::null(),
                ptr::null_mut(),
                ptr::null(),
                iv.as_ptr(),
                -1,
            )
        };
        check(rc, "EVP_CipherInit_ex(iv)")
    }

    /// Transforms `data` in place. `data.len()` must be a multiple of 16 (checked by callers:
    /// sector sizes are) and fit in a C int.
    #[inline]
    pub(crate) fn update_in_place(&mut self, data: &mut [u8]) -> Result<()> {
        debug_assert!(data.len() % 16 == 0 && data.len() <= i32::MAX as usize);
        let mut out_len: c_int = 0;
        // SAFETY: in == out is allowed for these modes; the buffer is valid for data.len() bytes
        // and, with padding off and whole blocks, EVP writes exactly data.len() bytes.
        let rc = unsafe {
            sys::EVP_CipherUpdate(
                self.ctx,
                data.as_mut_ptr(),
                &mut out_len,
                data.as_ptr(),
                data.len() as c_int,
            )
        };
        check(rc, "EVP_CipherUpdate")?;
        if out_len as usize != data.len() {
            return Err(Error::Bug("EVP_CipherUpdate returned a short output"));
        }
        Ok(())
    }

    /// Transforms `src` into `dst` (same length, multiple of 16).
    #[inline]
    pub(crate) fn update(&mut self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        debug_assert!(src.len() == dst.len() && src.len() % 16 == 0);
        let mut out_len: c_int = 0;
        // SAFETY: both buffers are valid for src.len() bytes and do not overlap (distinct
        // borrows); EVP writes exactly src.len() bytes with padding off.
        let rc = unsafe {
            sys::EVP_CipherUpdate(
                self.ctx,
                dst.as_mut_ptr(),
                &mut out_len,
                src.as_ptr(),
                src.len() as c_int,
            )
        };
        check(rc, "EVP_CipherUpdate")?;
        if out_len as usize != src.len() {
            return Err(Error::Bug("EVP_CipherUpdate returned a short output"));
        }
        Ok(())
    }
}

impl Drop for EvpCtx {
    fn drop(&mut self) {
        // SAFETY: ctx came from EVP_CIPHER_CTX_new and is freed once; AWS-LC cleanses the key
        // schedule in EVP_CIPHER_CTX_free.
        unsafe { sys::EVP_CIPHER_CTX_free(self.ctx) };
    }
}
