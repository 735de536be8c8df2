//! The call header: 16 bytes each rank sends its right neighbour and reads from its left one before a pass
//! (a magic word, the element and wire types, the element count), so ranks that disagree about what they reduce
//! fail with [`RingError::Mismatch`] instead of adding unrelated bytes.

use std::ops::Range;

use super::wait::{io_error, retry, wait, Clock, Watch};
use super::{Codec, Elem, Links, Phase, RingError, Side};

const MAGIC: u32 = 0x444c_5246; // "DLRF"

/// The header's type word: the element type in the low byte, the wire type in the next, the phase in the third.
fn type_word<T: Elem, C: Codec<T>>(phase: Phase) -> u32 {
    T::CODE | (C::CODE << 8) | (phase.code() << 16)
}

fn type_name(word: u32) -> String {
    let elem = match word & 0xff {
        1 => "float32",
        2 => "float64",
        _ => "unknown",
    };
    let wire = match (word >> 8) & 0xff {
        0 => "",
        1 => " over float16",
        2 => " over bfloat16",
        _ => " over an unknown wire type",
    };
    let phase = match word >> 16 {
        0 => "",
        1 => " (reduce-scatter)",
        2 => " (all-gather)",
        _ => " (an unknown call)",
    };
    format!("{elem}{wire}{phase}")
}

pub(super) fn exchange_header<T: Elem, C: Codec<T>>(
    len: u64,
    phase: Phase,
    links: &mut Links,
    watch: Watch<'_>,
) -> Result<(), RingError> {
    let ours_word = type_word::<T, C>(phase);
    let mut ours = [0u8; 16];
    ours[..4].copy_from_slice(&MAGIC.to_le_bytes());
    ours[4..8].copy_from_slice(&ours_word.to_le_bytes());
    ours[8..].copy_from_slice(&len.to_le_bytes());
    let mut theirs = [0u8; 16];
    let (mut sent, mut got) = (0usize, 0usize);
    let mut clock = Clock::new();
    while sent < 16 || got < 16 || links.right.pending() {
        let mut progressed = links.flush()?;
        if sent < 16 {
            match links.right.write(&ours[sent..]) {
                Ok(k) => (sent, progressed) = (sent + k, true),
                Err(e) if retry(&e) => {}
                Err(e) => return Err(io_error(Side::Right, e)),
            }
        }
        if got < 16 {
            match links.left.read(&mut theirs[got..]) {
                Ok(0) => return Err(RingError::Closed { side: Side::Left }),
                Ok(k) => (got, progressed) = (got + k, true),
                Err(e) if retry(&e) => {}
                Err(e) => return Err(io_error(Side::Left, e)),
            }
        }
        if progressed {
            clock.progressed();
        } else {
            let want_out = sent < 16 || links.right.pending();
            wait(links, got < 16, want_out, &mut clock, watch)?;
        }
    }
    let word = |r: Range<usize>| u32::from_le_bytes(theirs[r].try_into().unwrap_or_default());
    if word(0..4) != MAGIC {
        return Err(RingError::BadHeader);
    }
    let their_len = u64::from_le_bytes(theirs[8..].try_into().unwrap_or_default());
    let their_code = word(4..8);
    if their_code != ours_word || their_len != len {
        return Err(RingError::Mismatch {
            their_len,
            their_type: type_name(their_code),
            our_len: len,
            our_type: type_name(ours_word),
        });
    }
    Ok(())
}
