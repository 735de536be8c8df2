//! The ring over loopback sockets: sums, means, odd sizes, half precision on the wire, mismatches and
//! neighbours that leave, stall or stop.

use super::*;
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// `n` ranks' links over loopback sockets: rank r's right is rank r+1's left.
fn ring(n: usize) -> Vec<Links> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut rights = Vec::new();
    let mut lefts = Vec::new();
    for _ in 0..n {
        rights.push(TcpStream::connect(addr).unwrap());
        lefts.push(listener.accept().unwrap().0);
    }
    // rights[r] is accepted as lefts[r]; rank (r+1)'s left must be rank r's right.
    lefts.rotate_right(1);
    rights
        .into_iter()
        .zip(lefts)
        .map(|(right, left)| {
            right.set_nonblocking(true).unwrap();
            left.set_nonblocking(true).unwrap();
            Links {
                left: left.into(),
                right: right.into(),
            }
        })
        .collect()
}

/// `each(rank, n, input, links)` on every rank of a loopback ring of `inputs.len()`, each on its own thread.
fn each_rank<I: Send, R: Send>(
    inputs: Vec<I>,
    each: impl Fn(usize, usize, I, &mut Links) -> R + Sync,
) -> Vec<R> {
    let n = inputs.len();
    let links = ring(n);
    let each = &each;
    std::thread::scope(|s| {
        let handles: Vec<_> = inputs
            .into_iter()
            .zip(links)
            .enumerate()
            .map(|(rank, (input, mut links))| s.spawn(move || each(rank, n, input, &mut links)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn run<T: Elem + Copy>(inputs: Vec<Vec<T>>, op: Op) -> Vec<Result<Vec<T>, String>> {
    each_rank(inputs, |rank, n, mut data, links| {
        let d = Watch::stall(Duration::from_secs(10));
        allreduce(&mut data, rank, n, links, op, d)
            .map(|_| data)
            .map_err(|e| e.to_string())
    })
}

/// Like `run`, each rank with its own codec (`wires[r]`: 0 plain, 1 float16, 2 bfloat16).
fn run_wire(inputs: Vec<Vec<f32>>, wires: &[u8], op: Op) -> Vec<Result<Vec<f32>, String>> {
    each_rank(inputs, |rank, n, mut data, links| {
        let d = Watch::stall(Duration::from_secs(10));
        match wires[rank] {
            1 => allreduce_over::<f32, F16Wire>(&mut data, rank, n, links, op, d),
            2 => allreduce_over::<f32, Bf16Wire>(&mut data, rank, n, links, op, d),
            _ => allreduce(&mut data, rank, n, links, op, d),
        }
        .map(|_| data)
        .map_err(|e| e.to_string())
    })
}

#[test]
fn half_on_the_wire_sums_in_float32_and_every_rank_agrees() {
    for (wire, tol) in [(1u8, 2e-3f32), (2u8, 1.6e-2f32)] {
        for n in [2, 3, 5] {
            for len in [0, 1, 7, 1023, 100_003] {
                let ins: Vec<Vec<f32>> = (0..n)
                    .map(|r| {
                        (0..len)
                            .map(|i| ((i * 7919 + r * 104_729) % 2000) as f32 * 1e-3 - 1.0)
                            .collect()
                    })
                    .collect();
                let want: Vec<f32> = (0..len).map(|i| ins.iter().map(|v| v[i]).sum()).collect();
                let outs: Vec<Vec<f32>> = run_wire(ins, &vec![wire; n], Op::Sum)
                    .into_iter()
                    .map(|o| o.unwrap_or_else(|e| panic!("wire {wire} n={n} len={len}: {e}")))
                    .collect();
                for (i, w) in want.iter().enumerate() {
                    // Each hop rounds the partial sum to the wire type: error grows with the ranks.
                    let err = (outs[0][i] - w).abs();
                    assert!(
                        err <= tol * n as f32 * w.abs().max(1.0),
                        "wire {wire} n={n} i={i}: {err}"
                    );
                }
                for o in &outs[1..] {
                    assert!(
                        o.iter()
                            .zip(&outs[0])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "wire {wire} n={n} len={len}: ranks differ"
                    );
                }
            }
        }
    }
}

#[test]
fn half_on_the_wire_keeps_exact_values_exact() {
    // Small integers are exact in float16: a mean of them comes back exactly.
    let ins: Vec<Vec<f32>> = (0..4).map(|r| vec![r as f32 * 4.0; 4097]).collect();
    for out in run_wire(ins, &[1; 4], Op::Mean) {
        assert_eq!(out.unwrap(), vec![6.0f32; 4097]);
    }
}

#[test]
fn ranks_with_different_wire_types_refuse() {
    let ins: Vec<Vec<f32>> = (0..3).map(|_| vec![1.0f32; 100]).collect();
    let outs = run_wire(ins, &[0, 1, 1], Op::Sum);
    assert!(
        outs.iter().any(|o| o
            .as_ref()
            .is_err_and(|e| e.contains("float32 over float16"))),
        "{outs:?}"
    );
}

fn inputs(n: usize, len: usize) -> Vec<Vec<f64>> {
    (0..n)
        .map(|r| (0..len).map(|i| (r * 1000 + i) as f64 * 0.5).collect())
        .collect()
}

#[test]
fn chunks_cover_every_element_once() {
    for (len, n) in [(0, 3), (1, 4), (7, 3), (10, 10), (1000, 7)] {
        let mut next = 0;
        for c in 0..n {
            let r = chunk(len, n, c);
            assert_eq!(r.start, next);
            next = r.end;
        }
        assert_eq!(next, len);
    }
}

#[test]
fn sums_match_for_odd_sizes_and_rank_counts() {
    for n in 2..=6 {
        for len in [0, 1, 2, 5, 1023, 300_001] {
            let ins = inputs(n, len);
            let want: Vec<f64> = (0..len).map(|i| ins.iter().map(|v| v[i]).sum()).collect();
            for out in run(ins, Op::Sum) {
                let out = out.unwrap_or_else(|e| panic!("n={n} len={len}: {e}"));
                assert_eq!(out, want, "n={n} len={len}");
            }
        }
    }
}

#[test]
fn back_to_back_passes_on_the_same_links_stay_apart() {
    // A fast rank starts the next pass (its header) while a slow one still reads the last: never mixed.
    let n = 4;
    let links = ring(n);
    std::thread::scope(|s| {
        for (rank, mut l) in links.into_iter().enumerate() {
            s.spawn(move || {
                for pass in 0..30usize {
                    let len = 1 + (pass * 7919) % 5000;
                    let mut data: Vec<f64> = (0..len).map(|i| (rank + i + pass) as f64).collect();
                    allreduce(
                        &mut data,
                        rank,
                        n,
                        &mut l,
                        Op::Sum,
                        Watch::stall(Duration::from_secs(10)),
                    )
                    .unwrap();
                    let want: Vec<f64> = (0..len)
                        .map(|i| (0..n).map(|r| (r + i + pass) as f64).sum())
                        .collect();
                    assert_eq!(data, want, "rank {rank} pass {pass}");
                }
            });
        }
    });
}

#[test]
fn mean_divides_by_the_rank_count() {
    let ins: Vec<Vec<f32>> = (0..3).map(|r| vec![r as f32 * 3.0; 10]).collect();
    for out in run(ins, Op::Mean) {
        assert_eq!(out.unwrap(), vec![3.0f32; 10]);
    }
}

#[test]
fn every_rank_ends_with_identical_bits() {
    // Float addition is not associative: the ring must still give every rank the same bits.
    let ins: Vec<Vec<f32>> = (0..5)
        .map(|r| {
            (0..10_007)
                .map(|i| ((i * 7919 + r * 104_729) % 1000) as f32 * 1e-3 + 1e-7)
                .collect()
        })
        .collect();
    let outs: Vec<_> = run(ins, Op::Sum).into_iter().map(Result::unwrap).collect();
    for o in &outs[1..] {
        assert!(o
            .iter()
            .zip(&outs[0])
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn ranks_that_disagree_on_sizes_refuse() {
    let mut ins = inputs(3, 100);
    ins[1].push(1.0);
    let outs = run(ins, Op::Sum);
    assert!(
        outs.iter()
            .any(|o| o.as_ref().is_err_and(|e| e.contains("101"))),
        "{outs:?}"
    );
}

#[test]
fn a_neighbour_that_leaves_fails_the_pass_instead_of_hanging() {
    let mut links = ring(3);
    let gone = links.pop().unwrap(); // rank 2 never runs
    drop(gone);
    let t0 = Instant::now();
    let outs: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, mut l)| {
                s.spawn(move || {
                    let mut data = vec![1.0f32; 1 << 20];
                    allreduce(
                        &mut data,
                        rank,
                        3,
                        &mut l,
                        Op::Sum,
                        Watch::stall(Duration::from_secs(5)),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(outs.iter().all(Result::is_err), "{outs:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_silent_neighbour_stalls_out() {
    let mut links = ring(2);
    let _silent = links.pop().unwrap(); // open but never runs
    let mut mine = links.pop().unwrap();
    let mut data = vec![1.0f32; 10];
    let err = allreduce(
        &mut data,
        0,
        2,
        &mut mine,
        Op::Sum,
        Watch::stall(Duration::from_millis(300)),
    )
    .unwrap_err();
    assert!(matches!(err, RingError::Stalled { .. }), "{err}");
}

#[test]
fn a_silent_neighbour_that_fails_its_probe_ends_the_pass_long_before_the_stall_timeout() {
    let mut links = ring(2);
    let _frozen = links.pop().unwrap(); // open but never runs, as a SIGSTOPped process
    let mut mine = links.pop().unwrap();
    let mut data = vec![1.0f32; 10];
    let asked = std::sync::Mutex::new(Vec::new());
    let probe = |side: Side| {
        asked.lock().unwrap().push(side);
        Err("no answer within 1s".to_string())
    };
    let t0 = Instant::now();
    let err = allreduce(
        &mut data,
        0,
        2,
        &mut mine,
        Op::Sum,
        Watch {
            stall: Duration::from_secs(60),
            probe_every: Duration::from_millis(300),
            probe: Some(&probe),
            activity: 0,
            names: None,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            RingError::Unresponsive {
                side: Side::Left,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("no answer within 1s"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(*asked.lock().unwrap(), vec![Side::Left]); // the side it waited on, once
    assert_eq!(data, vec![1.0f32; 10]); // nothing reduced
}

#[test]
fn a_slow_neighbour_that_answers_its_probes_is_waited_for() {
    let mut links = ring(2);
    let mut late = links.pop().unwrap();
    let mut mine = links.pop().unwrap();
    let probes = std::sync::atomic::AtomicUsize::new(0);
    let probe = |_: Side| {
        probes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    };
    let watch = Watch {
        stall: Duration::from_secs(30),
        probe_every: Duration::from_millis(200),
        probe: Some(&probe),
        activity: 0,
        names: None,
    };
    let out = std::thread::scope(|s| {
        let h = s.spawn(move || {
            // Still computing for a while, then joins.
            std::thread::sleep(Duration::from_millis(1500));
            let mut d = vec![2.0f32; 10];
            allreduce(
                &mut d,
                1,
                2,
                &mut late,
                Op::Sum,
                Watch::stall(Duration::from_secs(30)),
            )
            .map(|_| d)
        });
        let mut d = vec![1.0f32; 10];
        let mine = allreduce(&mut d, 0, 2, &mut mine, Op::Sum, watch).map(|_| d);
        (mine, h.join().unwrap())
    });
    assert_eq!(out.0.unwrap(), vec![3.0f32; 10]);
    assert_eq!(out.1.unwrap(), vec![3.0f32; 10]);
    // Probed while it waited (about every 200 ms of the 1.5 s), not on every poll.
    let k = probes.load(std::sync::atomic::Ordering::Relaxed);
    assert!((3..=12).contains(&k), "{k} probes");
}

/// Each rank reduces `inputs[r]` out of place (`wire` as in `run_wire`), its input cut at `cuts_in` and its
/// output at `cuts_out` (element offsets), and returns the output and the input as it was left.
fn run_out_of_place(
    inputs: Vec<Vec<f32>>,
    cuts_in: &[usize],
    cuts_out: &[usize],
    wire: u8,
    op: Op,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    fn pieces(len: usize, cuts: &[usize]) -> Vec<std::ops::Range<usize>> {
        let mut at: Vec<usize> = cuts.iter().copied().filter(|&c| c <= len).collect();
        at.insert(0, 0);
        at.push(len);
        at.windows(2).map(|w| w[0]..w[1].max(w[0])).collect()
    }
    each_rank(inputs, |rank, n, input, links| {
        let len = input.len();
        let mut out = vec![f32::NAN; len];
        {
            let ins: Vec<&[f32]> = pieces(len, cuts_in)
                .into_iter()
                .map(|r| &input[r])
                .collect();
            let mut outs: Vec<&mut [f32]> = Vec::new();
            let mut rest: &mut [f32] = &mut out;
            for r in pieces(len, cuts_out) {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
                outs.push(head);
                rest = tail;
            }
            let mut data = OutOfPlace::new(ins, outs).unwrap();
            let d = Watch::stall(Duration::from_secs(10));
            match wire {
                1 => allreduce_into_over::<f32, F16Wire>(&mut data, rank, n, links, op, d),
                2 => allreduce_into_over::<f32, Bf16Wire>(&mut data, rank, n, links, op, d),
                _ => allreduce_into_over::<f32, Plain>(&mut data, rank, n, links, op, d),
            }
            .unwrap();
        }
        (out, input)
    })
}

#[test]
fn out_of_place_gives_the_in_place_bits_however_both_sides_are_cut() {
    // Fewer elements than ranks (empty chunks) too, and every wire type.
    for n in 1..=5 {
        for len in [0, 1, 2, 1_003] {
            let ins: Vec<Vec<f32>> = (0..n)
                .map(|r| {
                    (0..len)
                        .map(|i| ((i * 7919 + r * 104_729) % 1000) as f32 * 1e-3 + 1e-7)
                        .collect()
                })
                .collect();
            for (wire, op) in [(0u8, Op::Sum), (0, Op::Mean), (1, Op::Mean), (2, Op::Mean)] {
                let want = run_wire(ins.clone(), &vec![wire; n], op);
                let got = run_out_of_place(
                    ins.clone(),
                    &[0, 5, 5, 333, 800],
                    &[1, 400, 401, 1000],
                    wire,
                    op,
                );
                for (r, ((out, input), want)) in got.into_iter().zip(want).enumerate() {
                    let want = want.unwrap();
                    assert!(
                        out.len() == want.len()
                            && out
                                .iter()
                                .zip(&want)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "n {n} len {len} wire {wire} {op:?} rank {r}"
                    );
                    assert_eq!(input, ins[r], "the input is only read");
                }
            }
        }
    }
}

#[test]
fn a_mean_is_the_sum_times_one_over_n_on_every_rank() {
    // The mean scales each chunk as the pass finishes with it: the same bits as the sum scaled afterwards.
    for n in 2..=5 {
        let ins: Vec<Vec<f32>> = (0..n)
            .map(|r| {
                (0..777)
                    .map(|i| ((i * 31 + r * 17) % 97) as f32 * 0.37 + 0.1)
                    .collect()
            })
            .collect();
        let sums: Vec<_> = run(ins.clone(), Op::Sum)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let by = 1.0 / n as f64;
        let want: Vec<f32> = sums[0].iter().map(|x| x.scale(by)).collect();
        for mean in run(ins, Op::Mean) {
            let mean = mean.unwrap();
            assert!(
                mean.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "n {n}"
            );
        }
    }
}

#[test]
fn a_neighbour_that_dies_mid_pass_leaves_the_out_of_place_input_as_it_was() {
    // Rank 1 exchanges a valid header, sends part of its first chunk, and closes: rank 0 has reduced some of it
    // into its output by then. Its input, which it only reads, is unchanged (what lets a flat ring's atomic
    // call, whose parts are the input, leave them as they were), and the pass fails instead of hanging.
    let len = 1 << 16;
    let mut links = ring(2);
    let mut fake = links.pop().unwrap();
    let mut mine = links.pop().unwrap();
    let input: Vec<f32> = (0..len).map(|i| i as f32).collect();
    let mut out = vec![f32::NAN; len];
    let err = std::thread::scope(|s| {
        s.spawn(move || {
            let watch = Watch::stall(Duration::from_secs(5));
            exchange_header::<f32, Plain>(len as u64, Phase::Both, &mut fake, watch).unwrap();
            let part: Vec<u8> = bytemuck::cast_slice(&vec![1.0f32; 1000]).to_vec();
            let mut sent = 0;
            while sent < part.len() {
                match fake.right.write(&part[sent..]) {
                    Ok(k) => sent += k,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::yield_now()
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            std::thread::sleep(Duration::from_millis(100)); // rank 0 reads it before the link closes
        });
        let mut data = OutOfPlace::new(vec![&input[..]], vec![&mut out[..]]).unwrap();
        allreduce_into_over::<f32, Plain>(
            &mut data,
            0,
            2,
            &mut mine,
            Op::Mean,
            Watch::stall(Duration::from_secs(5)),
        )
        .unwrap_err()
    });
    assert!(
        matches!(err, RingError::Closed { .. } | RingError::Io { .. }),
        "{err}"
    );
    assert!(input.iter().enumerate().all(|(i, &x)| x == i as f32));
    // Some of the neighbour's elements arrived and were reduced into the output: the failure was mid-pass.
    assert!(out.iter().any(|x| !x.is_nan()));
}
