//! Encoded images (JPEG, PNG) decoded, resized and augmented into fixed-size `u8` rows: what the prefetch thread
//! does for image datasets, so the training loop only ever sees ready `(rows, height, width, channels)` batches.
//!
//! A dataset of encoded images is one byte buffer holding every file back to back and `n + 1` offsets into it
//! (image `i` is `data[offsets[i]..offsets[i + 1]]`). Decoding uses the `image` crate (zune-jpeg, png); an image
//! of another size is resized by `fast_image_resize` (SIMD) with a bilinear filter widened when shrinking
//! (antialiased: Keras' `image_dataset_from_directory` samples 2x2 pixels and aliases when it shrinks a lot).

use std::cell::RefCell;

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use image::DynamicImage;

thread_local! {
    /// One resizer per decoding thread: it keeps its scratch buffers from one image to the next.
    static RESIZER: RefCell<Resizer> = RefCell::new(Resizer::new());
}

/// How every image of a dataset comes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSpec {
    /// Rows of pixels after resizing.
    pub height: usize,
    /// Columns of pixels after resizing.
    pub width: usize,
    /// 1 (grayscale) or 3 (RGB).
    pub channels: usize,
    /// Flip each image left-right with probability 1/2 (training augmentation).
    pub flip: bool,
}

impl ImageSpec {
    /// Checks the spec: a positive size, 1 or 3 channels, and a row size that fits in memory.
    pub fn new(
        height: usize,
        width: usize,
        channels: usize,
        flip: bool,
    ) -> Result<Self, ImageError> {
        if height == 0 || width == 0 {
            return Err(ImageError::Spec(format!(
                "image size {height}x{width} is empty"
            )));
        }
        if channels != 1 && channels != 3 {
            return Err(ImageError::Spec(format!(
                "images have 1 (grayscale) or 3 (RGB) channels, not {channels}"
            )));
        }
        if height > 1 << 15 || width > 1 << 15 {
            return Err(ImageError::Spec(format!(
                "image size {height}x{width} is larger than 32768 on a side"
            )));
        }
        Ok(ImageSpec {
            height,
            width,
            channels,
            flip,
        })
    }

    /// Bytes of one decoded image.
    pub fn row_bytes(&self) -> usize {
        self.height * self.width * self.channels
    }
}

/// Why an image could not be made.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ImageError {
    /// An unusable [`ImageSpec`].
    #[error("{0}")]
    Spec(String),
    /// Offsets that do not cut the data into images.
    #[error("offsets: {0}")]
    Offsets(String),
    /// A row past the last image.
    #[error("row {row} is out of range for {rows} images")]
    OutOfRange {
        /// The row asked for.
        row: u64,
        /// Images in the dataset.
        rows: usize,
    },
    /// An image whose bytes are no JPEG or PNG this decoder reads.
    #[error("image at row {row} ({bytes} bytes) could not be decoded: {reason}")]
    Decode {
        /// The image's row.
        row: u64,
        /// Its encoded size.
        bytes: usize,
        /// The decoder's message.
        reason: String,
    },
}

/// Checks that `offsets` (n + 1 of them) cut `data_len` bytes into n images: starting at 0, never decreasing, and
/// ending within the data.
pub fn check_offsets(offsets: &[u64], data_len: usize) -> Result<usize, ImageError> {
    let Some((&last, _)) = offsets.split_last() else {
        return Err(ImageError::Offsets(
            "there must be n + 1 offsets for n images".into(),
        ));
    };
    if offsets[0] != 0 {
        return Err(ImageError::Offsets(format!(
            "the first offset is {}, not 0",
            offsets[0]
        )));
    }
    if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(ImageError::Offsets(format!(
            "offset {} ({}) is before offset {i} ({})",
            i + 1,
            offsets[i + 1],
            offsets[i]
        )));
    }
    if last > data_len as u64 {
        return Err(ImageError::Offsets(format!(
            "the last offset ({last}) is past the data's {data_len} bytes"
        )));
    }
    Ok(offsets.len() - 1)
}

/// A 64-bit mix (splitmix64's finalizer): the flip of an image is a pure function of the seed, its row and its
/// position in the stream, so a run is reproducible and no state is shared between threads.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Whether the image at `row`, served at `position` of a stream seeded with `seed`, is flipped.
pub fn flips(seed: u64, row: u64, position: u64) -> bool {
    mix(seed ^ mix(row.wrapping_add(0x9e37_79b9_7f4a_7c15) ^ mix(position))) & 1 == 1
}

/// Decodes one encoded image into `out` (`spec.row_bytes()` bytes, row-major `height x width x channels`),
/// resizing it if its size differs and flipping it left-right if `flip`.
pub fn decode_into(
    bytes: &[u8],
    spec: &ImageSpec,
    flip: bool,
    out: &mut [u8],
) -> Result<(), String> {
    if out.len() != spec.row_bytes() {
        return Err(format!(
            "output of {} bytes for a {} byte image",
            out.len(),
            spec.row_bytes()
        ));
    }
    // A file's header may claim any size: decoding is bounded (16384 a side, 256 MiB), so a hostile or broken
    // file is an error, never an allocation that takes the worker down.
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(16_384);
    limits.max_image_height = Some(16_384);
    limits.max_alloc = Some(256 << 20);
    let mut reader = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| e.to_string())?;
    reader.limits(limits);
    let img = reader.decode().map_err(|e| e.to_string())?;
    let (iw, ih) = (img.width(), img.height());
    let (pixels, pixel_type) = match spec.channels {
        1 => (DynamicImage::into_luma8(img).into_raw(), PixelType::U8),
        _ => (DynamicImage::into_rgb8(img).into_raw(), PixelType::U8x3),
    };
    if (iw as usize, ih as usize) == (spec.width, spec.height) {
        out.copy_from_slice(&pixels);
    } else {
        let (w, h) = (spec.width as u32, spec.height as u32);
        let src = ImageRef::new(iw, ih, &pixels, pixel_type).map_err(|e| e.to_string())?;
        let mut dst = Image::from_slice_u8(w, h, out, pixel_type).map_err(|e| e.to_string())?;
        let options = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
        RESIZER
            .with_borrow_mut(|r| r.resize(&src, &mut dst, &options))
            .map_err(|e| e.to_string())?;
    }
    if flip {
        let pixel = spec.channels;
        for line in out.chunks_exact_mut(spec.width * pixel) {
            let (mut a, mut b) = (0, spec.width - 1);
            while a < b {
                for c in 0..pixel {
                    line.swap(a * pixel + c, b * pixel + c);
                }
                a += 1;
                b -= 1;
            }
        }
    }
    Ok(())
}

/// Decodes the images `rows` of a dataset (`data` cut by `offsets`, checked with [`check_offsets`]) into one
/// buffer of `rows.len()` images, on up to `threads` threads. `first_position` is the stream position of `rows[0]`
/// (for the flips); `seed` seeds them.
pub fn decode_rows(
    data: &[u8],
    offsets: &[u64],
    rows: &[u32],
    spec: &ImageSpec,
    threads: usize,
    seed: u64,
    first_position: u64,
) -> Result<Vec<u8>, ImageError> {
    let n = offsets.len().saturating_sub(1);
    let row_bytes = spec.row_bytes();
    let mut out = vec![0u8; rows.len() * row_bytes];
    if rows.is_empty() || row_bytes == 0 {
        return Ok(out);
    }
    let decode = |i: usize, row: u32, dst: &mut [u8]| -> Result<(), ImageError> {
        let r = row as usize;
        if r >= n {
            return Err(ImageError::OutOfRange {
                row: row.into(),
                rows: n,
            });
        }
        let (a, b) = (offsets[r] as usize, offsets[r + 1] as usize);
        let bytes = data.get(a..b).ok_or(ImageError::OutOfRange {
            row: row.into(),
            rows: n,
        })?;
        let flip = spec.flip && flips(seed, row.into(), first_position + i as u64);
        decode_into(bytes, spec, flip, dst).map_err(|reason| ImageError::Decode {
            row: row.into(),
            bytes: bytes.len(),
            reason,
        })
    };
    let threads = threads.clamp(1, rows.len());
    let per = rows.len().div_ceil(threads);
    let results: Vec<Result<(), ImageError>> = std::thread::scope(|s| {
        let handles: Vec<_> = out
            .chunks_mut(per * row_bytes)
            .zip(rows.chunks(per))
            .enumerate()
            .map(|(t, (dst, part))| {
                let decode = &decode;
                s.spawn(move || {
                    for (j, (row, d)) in part.iter().zip(dst.chunks_mut(row_bytes)).enumerate() {
                        decode(t * per + j, *row, d)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(ImageError::Spec("an image decoding thread panicked".into()))
                })
            })
            .collect()
    });
    results.into_iter().collect::<Result<Vec<()>, _>>()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageFormat, RgbImage};
    use std::io::Cursor;

    fn encoded(img: &RgbImage, format: ImageFormat) -> Vec<u8> {
        let mut v = Vec::new();
        img.write_to(&mut Cursor::new(&mut v), format).unwrap();
        v
    }

    /// A 4x3 image whose pixels tell their position (red = x, green = y).
    fn gradient() -> RgbImage {
        RgbImage::from_fn(4, 3, |x, y| image::Rgb([x as u8 * 60, y as u8 * 100, 7]))
    }

    fn dataset(files: &[Vec<u8>]) -> (Vec<u8>, Vec<u64>) {
        let mut data = Vec::new();
        let mut offsets = vec![0u64];
        for f in files {
            data.extend_from_slice(f);
            offsets.push(data.len() as u64);
        }
        (data, offsets)
    }

    #[test]
    fn png_decodes_exactly_and_flips() {
        let spec = ImageSpec::new(3, 4, 3, false).unwrap();
        let png = encoded(&gradient(), ImageFormat::Png);
        let mut out = vec![0; spec.row_bytes()];
        decode_into(&png, &spec, false, &mut out).unwrap();
        assert_eq!(out, gradient().into_raw());
        decode_into(&png, &spec, true, &mut out).unwrap();
        // First pixel of the first row is now the last one of the source row: x = 3.
        assert_eq!(&out[..3], &[180, 0, 7]);
        let grey = ImageSpec::new(3, 4, 1, false).unwrap();
        let mut g = vec![0; grey.row_bytes()];
        decode_into(&png, &grey, false, &mut g).unwrap();
        assert_eq!(g.len(), 12);
    }

    #[test]
    fn jpeg_decodes_and_resizes() {
        let big = RgbImage::from_fn(64, 48, |_, _| image::Rgb([200, 100, 50]));
        let jpg = encoded(&big, ImageFormat::Jpeg);
        let spec = ImageSpec::new(8, 16, 3, false).unwrap();
        let mut out = vec![0; spec.row_bytes()];
        decode_into(&jpg, &spec, false, &mut out).unwrap();
        for px in out.chunks(3) {
            // JPEG is lossy: a flat colour comes back within a few levels.
            assert!(
                px[0].abs_diff(200) <= 4 && px[1].abs_diff(100) <= 4 && px[2].abs_diff(50) <= 4
            );
        }
    }

    #[test]
    fn shrinking_averages_neighbours_and_flips_the_result() {
        // Columns alternate 0 and 200: halving the width averages each pair (no aliasing onto 0 or 200), and a
        // ramp keeps its order; flipping the decoded image mirrors the resized one.
        let stripes = RgbImage::from_fn(16, 4, |x, _| {
            image::Rgb([(x % 2) as u8 * 200, x as u8 * 16, 9])
        });
        let png = encoded(&stripes, ImageFormat::Png);
        let spec = ImageSpec::new(2, 8, 3, false).unwrap();
        let mut out = vec![0; spec.row_bytes()];
        decode_into(&png, &spec, false, &mut out).unwrap();
        let first_line = &out[..8 * 3];
        for px in first_line.chunks(3) {
            assert!(px[0].abs_diff(100) <= 30, "{first_line:?}");
            assert_eq!(px[2], 9);
        }
        let greens: Vec<u8> = first_line.chunks(3).map(|p| p[1]).collect();
        assert!(greens.windows(2).all(|w| w[0] < w[1]), "{greens:?}");
        let mut flipped = vec![0; spec.row_bytes()];
        decode_into(&png, &spec, true, &mut flipped).unwrap();
        for (a, b) in out.chunks(8 * 3).zip(flipped.chunks(8 * 3)) {
            let mirrored: Vec<u8> = a.chunks(3).rev().flatten().copied().collect();
            assert_eq!(mirrored, b);
        }
        let grey = ImageSpec::new(2, 8, 1, true).unwrap();
        let mut g = vec![0; grey.row_bytes()];
        decode_into(&png, &grey, true, &mut g).unwrap();
        assert!(g.windows(2).take(7).all(|w| w[0] >= w[1]), "{g:?}");
    }

    #[test]
    fn rows_decode_in_order_on_several_threads() {
        let files: Vec<Vec<u8>> = (0..7u8)
            .map(|k| {
                let img = RgbImage::from_fn(4, 3, |_, _| image::Rgb([k * 30, 0, 0]));
                encoded(&img, ImageFormat::Png)
            })
            .collect();
        let (data, offsets) = dataset(&files);
        assert_eq!(check_offsets(&offsets, data.len()), Ok(7));
        let spec = ImageSpec::new(3, 4, 3, false).unwrap();
        let rows = [6, 0, 3, 3, 5];
        for threads in [1, 2, 4, 16] {
            let out = decode_rows(&data, &offsets, &rows, &spec, threads, 0, 0).unwrap();
            let reds: Vec<u8> = out.chunks(spec.row_bytes()).map(|im| im[0]).collect();
            assert_eq!(reds, vec![180, 0, 90, 90, 150]);
        }
    }

    #[test]
    fn flips_are_reproducible_and_about_half() {
        let n = 10_000;
        let flipped = (0..n).filter(|&i| flips(42, i, i)).count();
        assert!((4_500..5_500).contains(&flipped), "{flipped}");
        assert_eq!(flips(1, 2, 3), flips(1, 2, 3));
        let differ = (0..100)
            .filter(|&i| flips(1, i, 0) != flips(2, i, 0))
            .count();
        assert!(differ > 20);
    }

    #[test]
    fn bad_input_is_an_error_naming_the_row() {
        let png = encoded(&gradient(), ImageFormat::Png);
        let (data, offsets) = dataset(&[png.clone(), b"not an image".to_vec(), png[..40].to_vec()]);
        let spec = ImageSpec::new(3, 4, 3, true).unwrap();
        let err = decode_rows(&data, &offsets, &[0, 1], &spec, 2, 0, 0).unwrap_err();
        assert!(
            matches!(
                err,
                ImageError::Decode {
                    row: 1,
                    bytes: 12,
                    ..
                }
            ),
            "{err}"
        );
        let err = decode_rows(&data, &offsets, &[2], &spec, 1, 0, 0).unwrap_err();
        assert!(matches!(err, ImageError::Decode { row: 2, .. }), "{err}");
        let err = decode_rows(&data, &offsets, &[3], &spec, 1, 0, 0).unwrap_err();
        assert_eq!(err, ImageError::OutOfRange { row: 3, rows: 3 });
        assert!(check_offsets(&[], 0).is_err());
        assert!(check_offsets(&[1, 2], 5).is_err());
        assert!(check_offsets(&[0, 5, 3], 9).is_err());
        assert!(check_offsets(&[0, 5, 10], 9).is_err());
        assert!(ImageSpec::new(0, 4, 3, false).is_err());
        assert!(ImageSpec::new(4, 4, 2, false).is_err());
        assert!(ImageSpec::new(1 << 16, 4, 3, false).is_err());
    }
}
