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

/// How far into a packet the direct reads go: past the Ethernet header, an IPv6 header with its
/// extension headers and the L4 header. The bound lets the verifier follow a variable offset from
/// the packet's start. At TC a field beyond it is read through the helper instead (`TcDirect`).
const DIRECT_MAX_OFFSET: usize = 512;

/// Where `size` bytes at `offset` start, if `data..data_end` holds them. Direct packet access
/// rather than a helper call per field (`bpf_xdp_load_bytes`, `bpf_skb_load_bytes`): at XDP the
/// helper was about half of the fast path's run time.
///
/// `data` and `data_end` must be read from the context by the function this is inlined into:
/// loaded by a caller and passed down as plain integers (LLVM does so for a non-inlined parser),
/// the packet pointers lose what the verifier knows of them.
#[inline(always)]
fn direct_at(data: usize, data_end: usize, offset: usize, size: usize) -> Result<usize, i64> {
    if offset > DIRECT_MAX_OFFSET {
        return Err(-1);
    }
    let at = data + offset;
    // At least two bytes: LLVM turns `at + 1 > end` into `end > at`, from which the verifier
    // learns no readable range. A one-byte field is never a packet's last byte in the headers
    // read here (a packet that ends there is truncated; at TC the helper reads it instead).
    let past = at + if size < 2 { 2 } else { size };
    if past > data_end {
        return Err(-1);
    }
    Ok(at)
}

/// Where `size` bytes at `offset` of an XDP frame start, if the frame holds them (the frame is
/// linear at XDP: there is nothing to pull).
#[inline(always)]
fn xdp_at(ctx: &XdpContext, offset: usize, size: usize) -> Result<usize, i64> {
    // Volatile: read here, in whatever function calls this (see `direct_at`).
    // SAFETY: the context points at the kernel's xdp_md for this run.
    let (data, data_end) = unsafe {
        let md = ctx.ctx;
        (core::ptr::read_volatile(&(*md).data) as usize, core::ptr::read_volatile(&(*md).data_end) as usize)
    };
    direct_at(data, data_end, offset, size)
}

/// A TC packet read in place, in the skb's linear part (`data..data_end`): the headers, for
/// nearly every packet (a driver or the stack puts them there; payload may sit in page
/// fragments). A field outside it (beyond the linear part, or past `DIRECT_MAX_OFFSET`) is an
/// error, as the helper's read is past the packet's end: the caller reads the packet again
/// through `TcContext` then (see `lb::parse_into`). Read only. Each read takes the pointers
/// afresh, so a view stays valid after a helper that moved the packet's data (a decapsulation),
/// though a parse's offsets from before it would not.
// Transparent: a view of the caller's context itself, so it takes no stack slot of its own in
// `lb::ingress`'s frame (on the IPv6 path `kr_lb_ingress`'s deepest chain is at the limit).
#[repr(transparent)]
pub struct TcDirect(TcContext);

impl TcDirect {
    #[inline(always)]
    pub fn of(ctx: &TcContext) -> &TcDirect {
        // SAFETY: `TcDirect` is a transparent wrapper of `TcContext`.
        unsafe { &*(ctx as *const TcContext as *const TcDirect) }
    }
}

impl Packet for TcDirect {
    #[inline(always)]
    fn load<T>(&self, offset: usize) -> Result<T, i64> {
        // Volatile: read here, in whatever function calls this (see `direct_at`).
        // SAFETY: the context's skb pointer is valid for this run.
        let (data, data_end) = unsafe {
            let skb = self.0.skb.skb;
            (core::ptr::read_volatile(&(*skb).data) as usize, core::ptr::read_volatile(&(*skb).data_end) as usize)
        };
        let at = direct_at(data, data_end, offset, size_of::<T>())?;
        // A plain (aligned) read, one load instruction per word: `read_unaligned` is a load per
        // byte on BPF (LLVM may not assume the target takes misaligned loads), and those bytes,
        // spilled while an IPv6 address is put together, made the IPv6 parser's frame 304 bytes,
        // past what `kr_lb_ingress`'s deepest chain leaves it. The kernel runs a misaligned
        // packet load as it is (the verifier checks packet alignment only with
        // `BPF_F_STRICT_ALIGNMENT`, or on architectures without efficient misaligned access,
        // where it assumes the IP header 4-byte aligned, as every address read here then is), and
        // nothing here derives anything from the pointer's alignment.
        // SAFETY: `at..at + size_of::<T>()` lies inside the linear part (checked above).
        Ok(unsafe { core::ptr::read(at as *const T) })
    }
    #[inline(always)]
    fn len(&self) -> u32 {
        // The whole packet, as `TcContext::len`: byte counts must not depend on the view.
        self.0.len()
    }
    #[inline(always)]
    fn ifindex(&self) -> u32 {
        Packet::ifindex(&self.0)
    }
}

/// One field of a TC packet: read in place where the linear part holds it, through the helper
/// otherwise. For the few reads a program makes before (or instead of) a parse: the ethertype,
/// a gate's address; a parse goes through one view or the other whole (`lb::parse_into`).
#[inline(always)]
pub fn load<T>(ctx: &TcContext, offset: usize) -> Result<T, i64> {
    TcDirect::of(ctx).load(offset).or_else(|_| ctx.load(offset))
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
