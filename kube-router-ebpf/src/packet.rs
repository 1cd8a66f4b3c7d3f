//! Reading a packet the same way at TC and XDP, so the load balancer's parser serves both hooks.
use aya_ebpf::programs::{TcContext, XdpContext};

pub trait Packet {
    /// The `T` at byte `offset`, if the packet holds it.
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

/// How far into an XDP frame the programs read and write: past the Ethernet header, an IPv6
/// header with its extension headers and the L4 header. The bound lets the verifier follow a
/// variable offset from the frame's start.
const XDP_MAX_OFFSET: usize = 512;

/// Where `size` bytes at `offset` of an XDP frame start, if the frame holds them. Direct packet
/// access rather than `bpf_xdp_load_bytes` / `bpf_xdp_store_bytes`: a helper call per field was
/// about half of the fast path's run time (the frame is linear at XDP, there is nothing to pull).
#[inline(always)]
fn xdp_at(ctx: &XdpContext, offset: usize, size: usize) -> Result<usize, i64> {
    if offset > XDP_MAX_OFFSET {
        return Err(-1);
    }
    // Volatile: read here, in whatever function calls this. Loaded by a caller and passed down
    // as plain integers (LLVM does so for a non-inlined parser), the packet pointers lose what
    // the verifier knows of them.
    // SAFETY: the context points at the kernel's xdp_md for this run.
    let (data, data_end) = unsafe {
        let md = ctx.ctx;
        (core::ptr::read_volatile(&(*md).data) as usize, core::ptr::read_volatile(&(*md).data_end) as usize)
    };
    let at = data + offset;
    // At least two bytes: LLVM turns `at + 1 > end` into `end > at`, from which the verifier
    // learns no readable range. A one-byte field is never a frame's last byte in the headers
    // read here (a frame that ends there is truncated, and passed on untouched either way).
    let past = at + if size < 2 { 2 } else { size };
    if past > data_end {
        return Err(-1);
    }
    Ok(at)
}

impl Packet for XdpContext {
    #[inline(always)]
    fn load<T>(&self, offset: usize) -> Result<T, i64> {
        let at = xdp_at(self, offset, size_of::<T>())?;
        // SAFETY: `at..at + size_of::<T>()` lies inside the frame (checked above); packet data
        // has no alignment guarantee.
        Ok(unsafe { core::ptr::read_unaligned(at as *const T) })
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
    let at = xdp_at(ctx, offset, size_of::<T>())?;
    // SAFETY: as in `load`; the frame is writable at XDP.
    unsafe { core::ptr::write_unaligned(at as *mut T, core::ptr::read(value)) };
    Ok(())
}
