//! Ring all-reduce between real daemons on loopback: peer links admitted by each daemon's guard, token checked.

use std::time::Duration;

use ddlf_collective::{CollectiveError, LocalSpec, Op, PeerTls, Request, Ring, RingSpec};
use ddlf_core::auth::Token;
use ddlf_worker::{Daemon, DaemonConfig};

fn daemons(n: usize, token: &str) -> Vec<Daemon> {
    (0..n)
        .map(|_| {
            Daemon::start(DaemonConfig {
                listen: "127.0.0.1:0".into(),
                token: Token::new(token),
                ..Default::default()
            })
            .unwrap()
            .0
        })
        .collect()
}

fn spec(daemons: &[Daemon], group: u128, rank: usize, streams: usize) -> RingSpec {
    RingSpec {
        group,
        rank,
        addresses: daemons.iter().map(|d| d.local_addr().to_string()).collect(),
        streams,
        timeout: Duration::from_secs(5),
        liveness: LIVENESS,
        tls: None,
        local: None,
    }
}

/// The liveness bound of the rings in these tests.
const LIVENESS: Duration = Duration::from_secs(4);

/// Every rank reduces `rounds` times on one ring; returns each rank's results.
fn reduce_all(
    daemons: &[Daemon],
    group: u128,
    streams: usize,
    token: &str,
    len: usize,
) -> Vec<Result<Vec<f32>, String>> {
    reduce_all_with(daemons, group, streams, token, len, LIVENESS, None)
}

/// [`reduce_all`] with a liveness bound and, for TLS daemons, the authority each rank trusts.
fn reduce_all_with(
    daemons: &[Daemon],
    group: u128,
    streams: usize,
    token: &str,
    len: usize,
    liveness: Duration,
    ca: Option<&[u8]>,
) -> Vec<Result<Vec<f32>, String>> {
    let n = daemons.len();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let spec = RingSpec {
                    liveness,
                    tls: ca.map(|ca| PeerTls::new(ca, None).unwrap()),
                    ..spec(daemons, group, rank, streams)
                };
                let token = Token::new(token);
                s.spawn(move || {
                    let mut ring = Ring::new(spec, token).map_err(|e| e.to_string())?;
                    let mut data = vec![0f32; len];
                    for round in 0..3 {
                        data = (0..len)
                            .map(|i| (rank * 10 + i % 7 + round) as f32)
                            .collect();
                        ring.run(Request::allreduce(&mut data, Op::Sum))
                            .map_err(|e| e.to_string())?;
                    }
                    Ok(data)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_on_three_daemons_sum_with_one_and_several_streams() {
    let ds = daemons(3, "s3cret");
    for (group, streams) in [(1u128, 1usize), (2, 3)] {
        let len = 100_003;
        let want: Vec<f32> = (0..len)
            .map(|i| (0..3).map(|r| (r * 10 + i % 7 + 2) as f32).sum())
            .collect();
        for out in reduce_all(&ds, group, streams, "s3cret", len) {
            assert_eq!(out.unwrap(), want, "streams={streams}");
        }
    }
}

#[test]
fn a_liveness_under_four_seconds_still_forms_the_ring() {
    // A cluster with heartbeat_timeout=1.5 asks for 1.5 s: its keepalive probe (liveness / 4) once rounded down
    // to 0 s, which the kernel refuses, and every ring failed with EINVAL (found by `benchmarks chaos`).
    let ds = daemons(4, "s3cret");
    let len = 10_001;
    let want: Vec<f32> = (0..len)
        .map(|i| (0..4).map(|r| (r * 10 + i % 7 + 2) as f32).sum())
        .collect();
    for out in reduce_all_with(&ds, 3, 1, "s3cret", len, Duration::from_millis(1500), None) {
        assert_eq!(out.unwrap(), want);
    }
}

#[test]
fn a_peer_link_with_the_wrong_token_is_refused_before_it_is_read() {
    let ds = daemons(2, "right-token");
    let outs = reduce_all(&ds, 7, 1, "wrong-token", 10);
    for out in &outs {
        let err = out.as_ref().unwrap_err();
        assert!(err.contains("token"), "{err}");
    }
    // The daemons counted the refusals and still serve a ring with the right token.
    assert!(ds.iter().all(|d| d
        .state()
        .rejected
        .load(std::sync::atomic::Ordering::Relaxed)
        >= 1));
    assert!(reduce_all(&ds, 8, 1, "right-token", 10)
        .iter()
        .all(Result::is_ok));
}

#[test]
fn a_rank_that_never_comes_fails_its_neighbours_within_the_timeout() {
    let ds = daemons(3, "t");
    let t0 = std::time::Instant::now();
    let outs: Vec<Result<(), CollectiveError>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2) // rank 2 never joins
            .map(|rank| {
                let mut sp = spec(&ds, 9, rank, 1);
                sp.timeout = Duration::from_secs(1);
                s.spawn(move || {
                    let mut ring = Ring::new(sp, Token::new("t"))?;
                    ring.run(Request::allreduce(&mut [1f32; 16], Op::Sum))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(outs.iter().all(Result::is_err), "{outs:?}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    // A failed ring is spent: later calls refuse instead of touching half-closed links.
    let mut sp = spec(&ds, 9, 0, 1);
    sp.timeout = Duration::from_millis(200);
    let mut ring = Ring::new(sp, Token::new("t")).unwrap();
    assert!(ring
        .run(Request::allreduce(&mut [1f32; 4], Op::Sum))
        .is_err());
    let again = ring
        .run(Request::allreduce(&mut [1f32; 4], Op::Sum))
        .unwrap_err();
    assert!(matches!(again, CollectiveError::Spent(_)), "{again}");
}

#[test]
fn a_stopped_rank_fails_its_neighbours_within_the_liveness_bound_not_the_timeout() {
    // A stopped process (SIGSTOP) keeps its port: its kernel still accepts connections, and nothing answers.
    let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ds = daemons(2, "t");
    let mut addresses: Vec<String> = ds.iter().map(|d| d.local_addr().to_string()).collect();
    addresses.push(frozen.local_addr().unwrap().to_string());
    let t0 = std::time::Instant::now();
    let outs: Vec<Result<(), CollectiveError>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let sp = RingSpec {
                    group: 11,
                    rank,
                    addresses: addresses.clone(),
                    streams: 1,
                    timeout: Duration::from_secs(120),
                    liveness: Duration::from_secs(1),
                    tls: None,
                    local: None,
                };
                s.spawn(move || {
                    let mut ring = Ring::new(sp, Token::new("t"))?;
                    ring.run(Request::allreduce(&mut [1f32; 16], Op::Sum))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(6), "took {took:?}");
    for out in &outs {
        let err = out.as_ref().unwrap_err().to_string();
        // Rank 0 waits on rank 2 (its left), rank 1 on rank 0 or on rank 2 (its right): whichever is named
        // first, the frozen rank's failure ends both.
        assert!(err.contains("rank"), "{err}");
    }
    let rank0 = outs[0].as_ref().unwrap_err();
    assert!(
        matches!(rank0, CollectiveError::Ring { rank: 2, .. }),
        "{rank0}"
    );
    assert!(rank0.to_string().contains("liveness probe"), "{rank0}");
}

#[test]
fn a_rank_that_joins_late_but_answers_its_probes_is_waited_for() {
    let ds = daemons(3, "t");
    let outs: Vec<Result<Vec<f32>, CollectiveError>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|rank| {
                let mut sp = spec(&ds, 12, rank, 1);
                sp.timeout = Duration::from_secs(30);
                sp.liveness = Duration::from_secs(1);
                s.spawn(move || {
                    if rank == 2 {
                        // Still computing for three liveness periods before it joins.
                        std::thread::sleep(Duration::from_secs(3));
                    }
                    let mut ring = Ring::new(sp, Token::new("t"))?;
                    let mut data = vec![rank as f32; 8];
                    ring.run(Request::allreduce(&mut data, Op::Sum))?;
                    Ok(data)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for out in outs {
        assert_eq!(out.unwrap(), vec![3.0f32; 8]);
    }
}

/// A CA and a certificate for 127.0.0.1 signed by it, plus an unrelated CA, made with the system `openssl` (as
/// the Python tests make theirs). Returns (ca, cert, key, other ca) PEMs.
fn certificates() -> (Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>) {
    let dir = std::env::temp_dir().join(format!(
        "ddlf-peer-tls-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("the system openssl (the test suite's certificates are made with it)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    for (name, cn) in [("ca", "ddlf-test-ca"), ("other", "someone-else")] {
        let (key, pem, subj) = (
            format!("{name}.key"),
            format!("{name}.pem"),
            format!("/CN={cn}"),
        );
        openssl(&[
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &pem,
            "-days", "2", "-subj", &subj,
        ]);
    }
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(
        dir.join("ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "ext",
    ]);
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let out = (
        read("ca.pem"),
        read("server.pem"),
        read("server.key"),
        read("other.pem"),
    );
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn tls_daemons(n: usize, token: &str, cert: &[u8], key: &[u8]) -> Vec<Daemon> {
    (0..n)
        .map(|_| {
            let mut config = DaemonConfig {
                listen: "127.0.0.1:0".into(),
                token: Token::new(token),
                ..Default::default()
            };
            config.server.tls = Some(ddlf_net::ServerTls {
                cert_pem: cert.to_vec(),
                key_pem: key.to_vec(),
            });
            Daemon::start(config).unwrap().0
        })
        .collect()
}

#[test]
fn tls_daemons_reduce_over_encrypted_peer_links_and_refuse_the_rest() {
    let (ca, cert, key, other_ca) = certificates();
    let ds = tls_daemons(3, "tls-token", &cert, &key);
    // More than the TLS buffer per pass (1 MiB): writes wait for it to drain mid-pass.
    for (group, streams, len) in [(21u128, 1usize, 1_000_003usize), (22, 2, 7)] {
        let want: Vec<f32> = (0..len)
            .map(|i| (0..3).map(|r| (r * 10 + i % 7 + 2) as f32).sum())
            .collect();
        for out in reduce_all_with(&ds, group, streams, "tls-token", len, LIVENESS, Some(&ca)) {
            assert_eq!(out.unwrap(), want, "streams={streams}");
        }
    }
    // Plaintext links to a TLS daemon: its handshake fails on them, nothing is admitted.
    for out in reduce_all_with(&ds, 23, 1, "tls-token", 10, LIVENESS, None) {
        let err = out.unwrap_err();
        assert!(err.contains("a TLS daemon"), "{err}");
    }
    // A certificate the ring does not trust is refused by the opening rank.
    for out in reduce_all_with(&ds, 24, 1, "tls-token", 10, LIVENESS, Some(&other_ca)) {
        let err = out.unwrap_err();
        assert!(err.contains("certificate"), "{err}");
    }
    // Inside the tunnel, the token is still checked before anything else is read.
    let before: u64 = ds
        .iter()
        .map(|d| {
            d.state()
                .rejected
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    for out in reduce_all_with(&ds, 25, 1, "wrong-token", 10, LIVENESS, Some(&ca)) {
        let err = out.unwrap_err();
        assert!(err.contains("token"), "{err}");
    }
    let after: u64 = ds
        .iter()
        .map(|d| {
            d.state()
                .rejected
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    assert!(after > before);
    // The daemons still serve a good ring afterwards.
    assert!(
        reduce_all_with(&ds, 26, 1, "tls-token", 10, LIVENESS, Some(&ca))
            .iter()
            .all(Result::is_ok)
    );
}

/// Hierarchical ranks over `hosts` (each a list of daemon indices; the first is the host's leader): every rank's
/// spec, in the order of `hosts` flattened.
fn hierarchical(daemons: &[Daemon], hosts: &[Vec<usize>], group: u128) -> Vec<RingSpec> {
    let addr = |i: usize| daemons[i].local_addr().to_string();
    let leaders: Vec<String> = hosts.iter().map(|h| addr(h[0])).collect();
    let total = hosts.iter().map(Vec::len).sum();
    let mut specs = Vec::new();
    for (h, members) in hosts.iter().enumerate() {
        for index in 0..members.len() {
            specs.push(RingSpec {
                group,
                rank: h,
                addresses: leaders.clone(),
                streams: 1,
                timeout: Duration::from_secs(20),
                liveness: Duration::from_secs(2),
                tls: None,
                local: Some(LocalSpec {
                    index,
                    addresses: members.iter().map(|&i| addr(i)).collect(),
                    total,
                }),
            });
        }
    }
    specs
}

/// `f(rank, ring)` on every rank of `specs` at once, each on its own thread with its own ring; the results in rank
/// order.
fn each_rank<R: Send>(
    specs: Vec<RingSpec>,
    token: &str,
    f: impl Fn(usize, &mut Ring) -> Result<R, CollectiveError> + Sync,
) -> Vec<Result<R, CollectiveError>> {
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = specs
            .into_iter()
            .enumerate()
            .map(|(r, spec)| s.spawn(move || f(r, &mut Ring::new(spec, Token::new(token))?)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn hierarchical_ranks_sum_and_average_through_shared_memory_and_the_leaders_ring() {
    let ds = daemons(5, "h");
    // Two hosts of two, and uneven hosts (three and one; a single host of two: no ring at all).
    for (group, hosts) in [
        (31u128, vec![vec![0, 1], vec![2, 3]]),
        (32, vec![vec![0, 1, 2], vec![3]]),
        (33, vec![vec![3, 4]]),
    ] {
        let specs = hierarchical(&ds, &hosts, group);
        let n = specs.len();
        let outs: Vec<Result<Vec<Vec<f32>>, CollectiveError>> = std::thread::scope(|s| {
            let hs: Vec<_> = specs
                .into_iter()
                .enumerate()
                .map(|(r, spec)| {
                    s.spawn(move || {
                        let mut ring = Ring::new(spec, Token::new("h"))?;
                        let mut got = Vec::new();
                        // Odd sizes, one element, shapes alternating between calls, and a mean.
                        for (len, op) in [
                            (100_003, Op::Sum),
                            (1, Op::Sum),
                            (7, Op::Mean),
                            (100_003, Op::Mean),
                        ] {
                            let mut data: Vec<f32> =
                                (0..len).map(|i| (r * 3 + i % 11) as f32).collect();
                            ring.run(Request::allreduce(&mut data, op))?;
                            got.push(data);
                        }
                        Ok(got)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want = |len: usize, mean: bool| -> Vec<f32> {
            (0..len)
                .map(|i| {
                    let sum: f32 = (0..n).map(|r| (r * 3 + i % 11) as f32).sum();
                    if mean {
                        (sum as f64 / n as f64) as f32
                    } else {
                        sum
                    }
                })
                .collect()
        };
        let first = outs[0].as_ref().unwrap();
        for out in &outs {
            let out = out.as_ref().unwrap();
            assert_eq!(out[0], want(100_003, false), "hosts {hosts:?}");
            assert_eq!(out[1], want(1, false));
            assert_eq!(out[2], want(7, true));
            // Every rank ends with the same bits.
            assert!(out.iter().zip(first).all(|(a, b)| a == b));
        }
    }
    // Nothing left in /dev/shm by the rings (every file removed once mapped).
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n.starts_with("ddlf-node-")
                && (n.contains(&format!("{:032x}", 31)) || n.contains(&format!("{:032x}", 32)))
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_stopped_member_fails_its_host_within_the_liveness_bound() {
    // Member 1 of host 0 is a stopped process: its port accepts, nothing answers, it never arrives.
    let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ds = daemons(3, "f");
    let mut specs = hierarchical(&ds, &[vec![0, 1], vec![2]], 41);
    for spec in &mut specs {
        if let Some(local) = spec.local.as_mut() {
            if local.addresses.len() == 2 {
                local.addresses[1] = frozen.local_addr().unwrap().to_string();
            }
        }
        spec.timeout = Duration::from_secs(120);
        spec.liveness = Duration::from_secs(1);
    }
    specs.remove(1); // the frozen member never runs
    let t0 = std::time::Instant::now();
    let outs: Vec<Result<(), CollectiveError>> = std::thread::scope(|s| {
        let hs: Vec<_> = specs
            .into_iter()
            .map(|spec| {
                s.spawn(move || {
                    let mut ring = Ring::new(spec, Token::new("f"))?;
                    ring.run(Request::allreduce(&mut [1f32; 64], Op::Sum))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(8), "took {took:?}");
    // The leader of host 0 names its frozen member; host 1's leader loses its ring neighbour.
    let leader = outs[0].as_ref().unwrap_err();
    assert!(
        matches!(leader, CollectiveError::Local { rank: 1, .. }),
        "{leader}"
    );
    assert!(outs[1].is_err(), "{:?}", outs[1]);
}

#[test]
fn hierarchical_members_that_disagree_on_the_shape_fail_together_at_once() {
    let ds = daemons(3, "d");
    let specs = hierarchical(&ds, &[vec![0, 1, 2]], 51);
    let t0 = std::time::Instant::now();
    let outs: Vec<Result<(), CollectiveError>> = std::thread::scope(|s| {
        let hs: Vec<_> = specs
            .into_iter()
            .enumerate()
            .map(|(r, spec)| {
                s.spawn(move || {
                    let mut ring = Ring::new(spec, Token::new("d"))?;
                    // A first call of one shape, then member 2 reduces a longer array than the others.
                    ring.run(Request::allreduce(&mut [1f32; 4], Op::Sum))?;
                    let mut data = vec![1f32; if r == 2 { 5 } else { 4 }];
                    ring.run(Request::allreduce(&mut data, Op::Sum))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    for out in &outs {
        let err = out.as_ref().unwrap_err().to_string();
        assert!(err.contains("disagree"), "{err}");
    }
}

#[test]
fn a_list_of_parts_reduces_as_their_concatenation_however_each_rank_cuts_it() {
    let ds = daemons(4, "parts");
    let len = 10_007usize;
    // A flat ring of three, a hierarchical ring of two hosts of two (shared memory, then the leaders), and one
    // host of three (shared memory alone: each member's own chunk summed from its parts, cut across chunks).
    let flat: Vec<RingSpec> = (0..3).map(|r| spec(&ds[..3], 41, r, 2)).collect();
    for specs in [
        flat,
        hierarchical(&ds, &[vec![0, 1], vec![2, 3]], 42),
        hierarchical(&ds, &[vec![0, 1, 2]], 43),
    ] {
        let n = specs.len();
        let outs = each_rank(specs, "parts", |r, ring| {
            let mut two = [0f32; 2];
            let short = ring.run(Request::allreduce_into(&[&[1.0]], &mut [&mut two], Op::Sum));
            assert!(
                matches!(short, Err(CollectiveError::Invalid(_))),
                "{short:?}"
            );
            let mut got = Vec::new();
            // In place, then out of place (`into`, cut elsewhere again; the parts only read).
            for (op, into) in [
                (Op::Sum, false),
                (Op::Mean, false),
                (Op::Sum, true),
                (Op::Mean, true),
            ] {
                let data: Vec<f32> = (0..len).map(|i| (r * 5 + i % 13) as f32).collect();
                // Each rank cuts the same elements differently: r + 1 parts, one of them empty.
                let mut pieces: Vec<Vec<f32>> = Vec::new();
                let mut at = 0;
                for k in 0..=r {
                    let end = if k == r { len } else { at + 997 * (k + 1) };
                    pieces.push(data[at..end].to_vec());
                    at = end;
                }
                pieces.insert(1, Vec::new());
                if into {
                    let cut = 3001 + 1000 * r;
                    let mut out = [vec![f32::NAN; cut], vec![], vec![f32::NAN; len - cut]];
                    let parts: Vec<&[f32]> = pieces.iter().map(|p| p.as_slice()).collect();
                    let mut dst: Vec<&mut [f32]> =
                        out.iter_mut().map(|p| p.as_mut_slice()).collect();
                    ring.run(Request::allreduce_into(&parts, &mut dst, op))?;
                    assert_eq!(pieces.concat(), data, "the parts are only read");
                    got.push(out.concat());
                    continue;
                }
                let mut parts: Vec<&mut [f32]> =
                    pieces.iter_mut().map(|p| p.as_mut_slice()).collect();
                ring.run(Request::allreduce_parts(&mut parts, op))?;
                got.push(pieces.concat());
            }
            Ok(got)
        });
        for out in &outs {
            let out = out.as_ref().unwrap();
            assert_eq!(out.len(), 4);
            for (got, mean) in out.iter().zip([false, true, false, true]) {
                for (i, v) in got.iter().enumerate() {
                    let sum: f32 = (0..n).map(|r| (r * 5 + i % 13) as f32).sum();
                    let want = if mean {
                        (sum as f64 / n as f64) as f32
                    } else {
                        sum
                    };
                    assert_eq!(*v, want, "element {i} of {n} ranks");
                }
            }
        }
    }
}

#[test]
fn a_requests_codec_sends_half_precision_on_flat_and_hierarchical_rings() {
    use ddlf_collective::F16Wire;
    let ds = daemons(4, "wire");
    let len = 1_001usize;
    // A flat ring (two streams), and two hosts whose leaders' ring carries the codec (the host's stage sums in
    // float32 whatever the codec).
    let flat: Vec<RingSpec> = (0..3).map(|r| spec(&ds[..3], 111, r, 2)).collect();
    for specs in [flat, hierarchical(&ds, &[vec![0, 1], vec![2, 3]], 112)] {
        let n = specs.len();
        let outs = each_rank(specs, "wire", |r, ring| {
            // Thirds: no float16 holds them exactly.
            let mut plain: Vec<f32> = (0..len).map(|i| 1.0 + (r + i) as f32 / 3.0).collect();
            let mut half = plain.clone();
            ring.run(Request::allreduce(&mut plain, Op::Sum))?;
            ring.run(Request::allreduce(&mut half, Op::Sum).codec::<F16Wire>())?;
            Ok((plain, half))
        });
        let (_, first) = outs[0].as_ref().unwrap();
        for out in &outs {
            let (plain, half) = out.as_ref().unwrap();
            // Every rank ends with the same bits, within float16's precision of the plain sums and not them.
            assert!(half
                .iter()
                .zip(first)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            for (p, h) in plain.iter().zip(half) {
                assert!(
                    (p - h).abs() <= p.abs() * n as f32 / 1024.0,
                    "{h} against {p}"
                );
            }
            assert_ne!(plain, half, "the codec did not reach the wire");
        }
    }
}

#[test]
fn a_reduce_scatter_then_an_all_gather_is_an_all_reduce_and_the_shards_tile_the_data() {
    use ddlf_collective::Bf16Wire;
    let ds = daemons(5, "zero");
    // Fewer elements than ranks, a prime length, and an even one.
    for len in [3usize, 10_007, 4096] {
        let flat: Vec<RingSpec> = (0..3)
            .map(|r| spec(&ds[..3], 60 + len as u128, r, 2))
            .collect();
        let topologies = [
            flat,
            hierarchical(&ds, &[vec![0, 1], vec![2, 3]], 70 + len as u128),
            hierarchical(&ds, &[vec![0, 1, 2], vec![3]], 80 + len as u128),
            hierarchical(&ds, &[vec![3, 4]], 90 + len as u128),
        ];
        for specs in topologies {
            let n = specs.len();
            let outs: Vec<Result<_, CollectiveError>> = std::thread::scope(|s| {
                let hs: Vec<_> = specs
                    .into_iter()
                    .enumerate()
                    .map(|(r, spec)| {
                        s.spawn(move || {
                            let mut ring = Ring::new(spec, Token::new("zero"))?;
                            let value = |i: usize| (r * 5 + i % 13) as f32;
                            // The mean's shard, then the shards gathered (each rank first spoils the rest).
                            let mut data: Vec<f32> = (0..len).map(value).collect();
                            let mine = ring.run(Request::reduce_scatter(&mut data, Op::Mean))?;
                            assert_eq!(mine, ring.shard(len));
                            let shard = data[mine.clone()].to_vec();
                            for (i, x) in data.iter_mut().enumerate() {
                                if !mine.contains(&i) {
                                    *x = f32::NAN;
                                }
                            }
                            ring.run(Request::allgather(&mut data))?;
                            // And an all-gather over bfloat16 (each shard rounded once, by its owner).
                            let mut half: Vec<f32> =
                                (0..len).map(|i| 1.0 + (i as f32) / 3.0).collect();
                            ring.run(Request::allgather(&mut half).codec::<Bf16Wire>())?;
                            Ok((mine, shard, data, half))
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let mean = |i: usize| {
                let sum: f32 = (0..n).map(|r| (r * 5 + i % 13) as f32).sum();
                (sum as f64 / n as f64) as f32
            };
            let mut covered = vec![0usize; len];
            let halves: Vec<Vec<f32>> =
                outs.iter().map(|o| o.as_ref().unwrap().3.clone()).collect();
            for out in &outs {
                let (mine, shard, data, _) = out.as_ref().unwrap();
                for (k, i) in mine.clone().enumerate() {
                    covered[i] += 1;
                    assert_eq!(shard[k], mean(i), "shard element {i} of {n} ranks");
                }
                for (i, v) in data.iter().enumerate() {
                    assert_eq!(
                        *v,
                        mean(i),
                        "gathered element {i} of {n} ranks, {len} elements"
                    );
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "{covered:?}");
            for h in &halves {
                assert_eq!(h.len(), len);
                assert!(h
                    .iter()
                    .zip(&halves[0])
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
                for (i, v) in h.iter().enumerate() {
                    let exact = 1.0 + (i as f32) / 3.0;
                    assert!((v - exact).abs() <= exact / 128.0, "{v} against {exact}");
                }
            }
        }
    }
}

#[test]
fn ranks_that_make_different_halves_fail_instead_of_mixing_them() {
    let ds = daemons(4, "mix");
    let flat: Vec<RingSpec> = (0..2).map(|r| spec(&ds[..2], 101, r, 1)).collect();
    for specs in [flat, hierarchical(&ds, &[vec![0, 1, 2]], 102)] {
        let outs: Vec<Result<(), CollectiveError>> = std::thread::scope(|s| {
            let hs: Vec<_> = specs
                .into_iter()
                .enumerate()
                .map(|(r, spec)| {
                    s.spawn(move || {
                        let mut ring = Ring::new(spec, Token::new("mix"))?;
                        let mut data = vec![1f32; 64];
                        match r {
                            0 => ring
                                .run(Request::reduce_scatter(&mut data, Op::Sum))
                                .map(|_| ()),
                            _ => ring.run(Request::allgather(&mut data)),
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for out in &outs {
            let err = out.as_ref().unwrap_err().to_string();
            assert!(
                err.contains("reduce-scatter")
                    || err.contains("disagree")
                    || err.contains("closed"),
                "{err}"
            );
        }
    }
}

#[test]
fn a_result_left_in_shared_memory_is_the_reduction_and_each_tag_keeps_its_own() {
    let ds = daemons(3, "shared");
    let len = 5_003usize;
    let specs = hierarchical(&ds, &[vec![0, 1, 2]], 51);
    let n = specs.len();
    let outs = each_rank(specs, "shared", |r, ring| {
        assert!(ring.shares_results());
        let a: Vec<f32> = (0..len).map(|i| (r * 3 + i % 7) as f32).collect();
        let b: Vec<f32> = (0..len).map(|i| (r + i % 5) as f32 * 0.5).collect();
        let (a1, a2) = a.split_at(1234);
        // Two calls of one length with different tags: the first result must survive the second.
        let first = ring.run(Request::allreduce_shared(&[a1, &[], a2], Op::Mean, 1))?;
        let second = ring.run(Request::allreduce_shared(&[&b], Op::Sum, 2))?;
        // An in-place call of the same length in between uses tag 0: neither result is touched.
        let mut c = vec![1f32; len];
        ring.run(Request::allreduce_parts(&mut [&mut c], Op::Sum))?;
        assert!(c.iter().all(|&v| v == n as f32));
        let floats = |res: &ddlf_collective::node::SharedResult| -> Vec<f32> {
            assert_eq!((res.start % 64, res.len), (0, len * 4));
            bytemuck::cast_slice::<u8, f32>(&res.map[res.start..res.start + res.len]).to_vec()
        };
        assert_eq!(
            a,
            (0..len).map(|i| (r * 3 + i % 7) as f32).collect::<Vec<_>>()
        );
        Ok(vec![floats(&first), floats(&second)])
    });
    for out in &outs {
        let out = out.as_ref().unwrap();
        for (i, (a, b)) in out[0].iter().zip(&out[1]).enumerate() {
            let sum_a: f32 = (0..n).map(|r| (r * 3 + i % 7) as f32).sum();
            let sum_b: f32 = (0..n).map(|r| (r + i % 5) as f32 * 0.5).sum();
            assert_eq!(*a, (sum_a as f64 / n as f64) as f32, "element {i}");
            assert_eq!(*b, sum_b, "element {i}");
        }
        assert_eq!((out[0].len(), out[1].len()), (len, len));
    }
    // A ring between hosts, or a flat ring, cannot leave the result in shared memory: refused before any call.
    let two_hosts = hierarchical(&ds, &[vec![0], vec![1]], 52);
    let mut ring = Ring::new(two_hosts[0].clone(), Token::new("shared")).unwrap();
    assert!(!ring.shares_results());
    let refused = ring.run(Request::allreduce_shared(&[&[1.0]], Op::Sum, 1));
    assert!(matches!(refused, Err(CollectiveError::Invalid(_))));
    let one_host = hierarchical(&ds, &[vec![2]], 53);
    let mut ring = Ring::new(one_host[0].clone(), Token::new("shared")).unwrap();
    // Tag 0 is every other call's (its region would be overwritten by them), and tags travel in 24 bits.
    for tag in [0, ddlf_collective::node::MAX_TAG] {
        let refused = ring.run(Request::allreduce_shared(&[&[1.0]], Op::Sum, tag));
        assert!(matches!(refused, Err(CollectiveError::Invalid(_))));
    }
}

#[test]
fn calls_of_many_lengths_reuse_the_hosts_files_instead_of_making_one_per_call() {
    // A model's buckets: more distinct lengths than a node keeps files for, cycling step after step.
    let lens = [5_003usize, 4_001, 5_002, 6_007, 17, 6_004, 4_003];
    let ds = daemons(4, "reuse");
    for (group, hosts) in [
        (61u128, vec![vec![0, 1, 2]]),
        (62, vec![vec![0, 1], vec![2, 3]]),
    ] {
        let specs = hierarchical(&ds, &hosts, group);
        let n = specs.len();
        let outs = each_rank(specs, "reuse", |r, ring| {
            let mut made = Vec::new();
            for step in 0..3 {
                for (b, &len) in lens.iter().enumerate() {
                    let src: Vec<f32> = (0..len)
                        .map(|i| (r * 5 + i % 9 + b + step) as f32)
                        .collect();
                    let mut out = vec![f32::NAN; len];
                    ring.run(Request::allreduce_into(&[&src], &mut [&mut out], Op::Sum))?;
                    for (i, v) in out.iter().enumerate() {
                        let want: usize = (0..n).map(|q| q * 5 + i % 9 + b + step).sum();
                        assert_eq!(*v, want as f32, "step {step}, length {len}, element {i}");
                    }
                }
                made.push(ring.shared_files_made().unwrap());
            }
            // A tagged result shorter than its file is as long as its call.
            if ring.shares_results() {
                // (Each call its own values: the second, shorter one must not read the first's.)
                for (len, value) in [(6_007usize, 1f32), (4_001, 2.0)] {
                    let src = vec![value; len];
                    let res = ring.run(Request::allreduce_shared(&[&src], Op::Sum, 7))?;
                    assert_eq!(res.len, len * 4);
                    let got: &[f32] =
                        bytemuck::cast_slice(&res.map[res.start..res.start + res.len]);
                    assert!(got.iter().all(|&v| v == n as f32 * value));
                }
            }
            Ok(made)
        });
        for out in outs {
            let made = out.unwrap();
            // Files are made on the first step only (at most one per length that no kept file holds), and the
            // later steps make none.
            assert!(made[0] <= 4, "{made:?}");
            assert_eq!((made[1], made[2]), (made[0], made[0]), "{made:?}");
        }
    }
}

#[test]
fn an_atomic_reduction_on_a_flat_ring_leaves_the_data_as_it_was_when_it_fails() {
    let ds = daemons(3, "atomic");
    let len = 300_001usize;
    let outs = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|rank| {
                let mut sp = spec(&ds, 71, rank, 1);
                sp.timeout = Duration::from_secs(2);
                s.spawn(move || -> Result<CollectiveError, CollectiveError> {
                    let mut ring = Ring::new(sp, Token::new("atomic"))?;
                    // One reduction that succeeds, through the kept buffer.
                    let mut data: Vec<f32> = (0..len).map(|i| (rank + i % 13) as f32).collect();
                    ring.run(Request::allreduce(&mut data, Op::Sum).atomic(true))?;
                    for (i, v) in data.iter().enumerate() {
                        assert_eq!(*v, (3 * (i % 13) + 3) as f32, "element {i}");
                    }
                    // Rank 2 passes one element too many: the ranks find out only once data flows (each
                    // checks its left neighbour's header), and rank 1 has summed rank 0's first chunk by then.
                    let mine = if rank == 2 { len + 1 } else { len };
                    let before: Vec<f32> = (0..mine).map(|i| (rank * 7 + i % 5) as f32).collect();
                    let mut data = before.clone();
                    let err = ring
                        .run(Request::allreduce(&mut data, Op::Sum).atomic(true))
                        .unwrap_err();
                    assert_eq!(
                        data, before,
                        "rank {rank}: a failed atomic reduction changed the data"
                    );
                    Ok(err)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for (rank, out) in outs.into_iter().enumerate() {
        let err = out.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(
            matches!(err, CollectiveError::Ring { .. }),
            "rank {rank}: {err}"
        );
    }
}
