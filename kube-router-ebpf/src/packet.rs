//! Reading a packet the same way at TC and XDP, so the load balancer's parser serves both hooks.
use aya_ebpf::{
    helpers::{bpf_xdp_load_bytes, bpf_xdp_store_bytes},
    programs::{TcContext, XdpContext},
    EbpfContext,
};

pub trait Packet {
    /// The `T` at byte `offset` (bounds-checked by the kernel).
    fn load<T>(&self, offset: usize) -> Result<T, i64>;
    /// The packet's length, Ethernet header included.
    fn len(&self) -> u32;
    /// The interface the packet is on.
    fn ifindex(&self) -> u32;
}

impl Packet for TcContext {
    #[inline(always)]
    fn load<T>(&self, offset: usize) -> Result<T, i64> {
        TcContext::load(self, offset)
    }
    #[inline(always)]
    fn len(&self) -> u32 {
        TcContext::len(self)
    }
    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: the context's skb pointer is valid for this run.
        unsafe { (*self.skb.skb).ifindex }
    }
}

// The load/store helpers rather than direct packet access: offsets past IPv4 options and IPv6
// extension headers are variable, which the helpers check for us as `bpf_skb_load_bytes` does.
impl Packet for XdpContext {
    #[inline(always)]
    fn load<T>(&self, offset: usize) -> Result<T, i64> {
        let mut value = core::mem::MaybeUninit::<T>::uninit();
        // SAFETY: the helper writes exactly size_of::<T>() bytes into `value` or fails.
        let rc = unsafe {
            bpf_xdp_load_bytes(
                self.as_ptr() as *mut _,
                offset as u32,
                value.as_mut_ptr() as *mut _,
                size_of::<T>() as u32,
            )
        };
        if rc < 0 {
            return Err(rc);
        }
        // SAFETY: fully written by the helper above.
        Ok(unsafe { value.assume_init() })
    }
    #[inline(always)]
    fn len(&self) -> u32 {
        (self.data_end() - self.data()) as u32
    }
    #[inline(always)]
    fn ifindex(&self) -> u32 {
        self.ingress_ifindex() as u32
    }
}

/// Writes `value` at byte `offset` of an XDP packet.
#[inline(always)]
pub fn xdp_store<T>(ctx: &XdpContext, offset: usize, value: &T) -> Result<(), i64> {
    // SAFETY: the helper reads size_of::<T>() bytes from `value`.
    let rc = unsafe {
        bpf_xdp_store_bytes(ctx.as_ptr() as *mut _, offset as u32, value as *const T as *mut _, size_of::<T>() as u32)
    };
    if rc < 0 {
        return Err(rc);
    }
    Ok(())
}
