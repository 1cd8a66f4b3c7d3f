//! Pod routing between nodes: the BGP speaker (`bgp`), the kernel routes it installs (`fib`),
//! the tunnels to nodes on other subnets (`overlay`), and the router the routing controller
//! drives (`router`: peers from Node objects, pod CIDRs and Service VIPs to advertise).
pub mod bgp;
pub mod fib;
pub mod overlay;
pub mod router;
