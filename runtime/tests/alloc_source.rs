//! Region sources: the virtual device and real host memory.

use kiln_runtime::alloc::{
    AllocError, Allocator, BfcAllocator, CachingAllocator, HostSource, KIB, MIB, RegionSource, SourceEvent,
    VirtualSource,
};

#[test]
fn virtual_source_counts_and_refuses() {
    let mut s = VirtualSource::with_capacity(3 * MIB).named("sim0");
    let a = s.alloc_region(MIB).unwrap();
    let b = s.alloc_region(2 * MIB).unwrap();
    assert_eq!(a % 4096, 0);
    assert!(b >= a + MIB as u64 + 4096, "regions are never adjacent");
    assert_eq!((s.held(), s.peak_held()), (3 * MIB, 3 * MIB));
    let err = s.alloc_region(1).unwrap_err();
    assert!(matches!(&err, AllocError::DeviceRefused { source_name, bytes: 1, .. } if source_name == "sim0"));
    assert!(err.to_string().contains("capacity 3.00 MiB"), "{err}");
    s.free_region(a, MIB);
    assert_eq!(s.held(), 2 * MIB);
    assert_eq!(s.live_regions(), [(b, 2 * MIB)]);
    assert_eq!(
        s.events(),
        [
            SourceEvent::Alloc { base: a, bytes: MIB },
            SourceEvent::Alloc { base: b, bytes: 2 * MIB },
            SourceEvent::Refused { bytes: 1 },
            SourceEvent::Free { base: a, bytes: MIB },
        ]
    );
    assert!(s.alloc_region(0).is_err());
}

#[test]
fn host_source_regions_are_aligned_memory() {
    let mut s = HostSource::with_capacity(8 * MIB);
    let base = s.alloc_region(MIB).unwrap();
    assert_eq!(base % 256, 0);
    assert!(s.contains(base, MIB));
    assert!(!s.contains(base, MIB + 1));
    assert!(s.bytes(base + MIB as u64, 1).is_none());
    s.bytes_mut(base, MIB).unwrap().fill(7);
    assert!(s.bytes(base, MIB).unwrap().iter().all(|&x| x == 7));
    assert!(s.alloc_region(8 * MIB).is_err(), "capacity");
    s.free_region(base, MIB);
    assert_eq!(s.held(), 0);
    assert!(s.bytes(base, 1).is_none());
}

#[test]
fn bfc_blocks_on_host_memory_are_writable() {
    let mut a = BfcAllocator::new(HostSource::new(), 64 * MIB);
    let blocks: Vec<_> = (1..=20).map(|i| a.allocate(i * 37 * KIB + i).unwrap()).collect();
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(b.addr % 256, 0);
        let mem = a.source_mut().bytes_mut(b.addr, b.requested).expect("inside a region");
        mem.fill(i as u8 + 1);
    }
    for (i, b) in blocks.iter().enumerate() {
        let mem = a.source().bytes(b.addr, b.requested).unwrap();
        assert!(mem.iter().all(|&x| x == i as u8 + 1), "block {i} was overwritten");
    }
    // Free half, reuse, write again: the survivors keep their contents.
    for b in blocks.iter().step_by(2) {
        a.deallocate(b.addr).unwrap();
    }
    let again: Vec<_> = (0..10).map(|_| a.allocate(30 * KIB).unwrap()).collect();
    for b in &again {
        a.source_mut().bytes_mut(b.addr, b.requested).unwrap().fill(0xee);
    }
    for (i, b) in blocks.iter().enumerate().skip(1).step_by(2) {
        assert!(a.source().bytes(b.addr, b.requested).unwrap().iter().all(|&x| x == i as u8 + 1));
    }
    assert_eq!(a.source().held(), a.stats().reserved);
}

#[test]
fn caching_blocks_on_host_memory_are_writable() {
    let mut a = CachingAllocator::new(HostSource::new(), Some(256 * MIB));
    let small = a.allocate(100).unwrap();
    let large = a.allocate(3 * MIB).unwrap();
    a.source_mut().bytes_mut(small.addr, 100).unwrap().copy_from_slice(&[42; 100]);
    let big = a.source_mut().bytes_mut(large.addr, 3 * MIB).unwrap();
    for (i, x) in big.iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    assert_eq!(a.source().bytes(small.addr, 100).unwrap(), &[42; 100]);
    let big = a.source().bytes(large.addr, 3 * MIB).unwrap();
    assert!(big.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
    assert_eq!(a.source().held(), 22 * MIB);
}
