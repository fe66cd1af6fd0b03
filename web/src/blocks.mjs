// A weights file rebuilt from its packed form (builder/export/packed.py): the GGUF's own blocks for the
// block-quantized tensors, the other tensors' bytes as they are. The graphs compute in fp32 on the values
// the torch reference computes on; the page downloads 5 bits a weight (Q4_1) instead of 32, and the
// caller checks the rebuilt file against the manifest's sha256 of the fp32 file.
//
// Q4_1 block (20 bytes, 32 weights): fp16 d, fp16 m, 16 bytes of 4-bit q (byte j: weight j in the low
// nibble, weight j + 16 in the high one); weight = d * q + m. Q8_0 (34 bytes): fp16 d, 32 int8 q; d * q.
// Each value is rounded to fp32 once, as numpy's fp32 arithmetic does in the import (gguf.quants): d * q
// is exact in a double and in fp32 (11 + 8 bits), so fround(d * q + m) is numpy's fp32 sum.

// The block table (weights, bytes per block) is the manifest's `blocks` (builder/contract.py's BLOCKS), which
// unpack checks against the layouts written out below.
const LAYOUT = { q4_1: [32, 20], q8_0: [32, 34] };

/** An IEEE half (as its 16 bits) as a number. */
export function half(bits) {
  const exp = (bits >> 10) & 0x1f;
  const frac = bits & 0x3ff;
  const sign = bits & 0x8000 ? -1 : 1;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1024 + frac) * 2 ** (exp - 25);
}

function unpackRows(kind, src, dst) {
  const size = LAYOUT[kind][1];
  const n = src.length / size;
  for (let b = 0; b < n; b += 1) {
    const o = b * size;
    const d = half(src[o] | (src[o + 1] << 8));
    const w = b * 32;
    if (kind === 'q4_1') {
      const m = half(src[o + 2] | (src[o + 3] << 8));
      for (let j = 0; j < 16; j += 1) {
        const q = src[o + 4 + j];
        dst[w + j] = d * (q & 15) + m;          // a Float32Array: the one rounding to fp32
        dst[w + j + 16] = d * (q >> 4) + m;
      }
    } else {
      for (let j = 0; j < 32; j += 1) dst[w + j] = d * ((src[o + 2 + j] << 24) >> 24);
    }
  }
}

// The q4 base's weights file (builder/export/nbits.py) comes from the same blocks, as onnxruntime's
// MatMulNBits and GatherBlockQuantized read them. A Q4_1 weight of `rows` rows and `n` blocks a row: its q
// packed two a byte in order (q4_1.q: rows x n x 16 bytes), its scales d (q4_1.d: rows x n fp32) and its
// minima transposed (q4_1.mT: n x rows fp32), zero points 0 (zeros). A Q8_0 weight: q + 128 (q8_0.q: rows
// x n x 32 bytes) and its scales (q8_0.d: rows x n fp32), zero points 128 (128s).
function blockParts(kind, src, out, rows) {
  const size = LAYOUT[kind.split('.')[0]][1];
  const n = src.length / size / rows;
  const f32 = kind.endsWith('.q') ? null : new Float32Array(out.buffer, out.byteOffset, out.length / 4);
  for (let r = 0; r < rows; r += 1) {
    for (let b = 0; b < n; b += 1) {
      const o = (r * n + b) * size;
      const i = r * n + b;
      if (kind === 'q4_1.d' || kind === 'q8_0.d') f32[i] = half(src[o] | (src[o + 1] << 8));
      else if (kind === 'q4_1.mT') f32[b * rows + r] = half(src[o + 2] | (src[o + 3] << 8));
      else if (kind === 'q8_0.q') for (let j = 0; j < 32; j += 1) out[i * 32 + j] = src[o + 2 + j] ^ 0x80;  // int8 + 128
      else {
        const q = (j) => (j < 16 ? src[o + 4 + j] & 15 : src[o + 4 + j - 16] >> 4);
        for (let j = 0; j < 16; j += 1) out[i * 16 + j] = q(2 * j) | (q(2 * j + 1) << 4);
      }
    }
  }
}

// the bytes a segment of this kind holds per block of 32 weights (the blocks it reads: LAYOUT's bytes each)
const PER_BLOCK = { q4_1: 128, q8_0: 128, 'q4_1.q': 16, 'q4_1.d': 4, 'q4_1.mT': 4, 'q8_0.q': 32, 'q8_0.d': 4 };

/**
 * The weights file `spec` describes (manifest files[name].packed), `size` bytes, from its blocks file.
 * @param {{segments: {at: number, bytes: number, from: number, kind: string, rows?: number}[]}} spec
 * @param {Uint8Array} packed the blocks file
 * @param {number} size the weights file's bytes
 * @param {Object<string, number[]>} blocks the manifest's block table: kind -> [weights, bytes] of one block
 * @returns {Uint8Array}
 */
export function unpack(spec, packed, size, blocks) {
  for (const s of spec.segments) {
    const kind = s.kind.split('.')[0];
    if (!(kind in LAYOUT)) continue;
    if (!blocks?.[kind] || blocks[kind][0] !== LAYOUT[kind][0] || blocks[kind][1] !== LAYOUT[kind][1]) {
      throw new Error(`packed weights: the manifest's ${kind} blocks (${blocks?.[kind]}) are not the ones this page reads `
        + `(${LAYOUT[kind]} weights, bytes): rebuild the site`);
    }
  }
  const out = new Uint8Array(size);
  let end = 0;
  for (const s of spec.segments) {
    if (s.at < end || s.at + s.bytes > size || s.at % 4) throw new Error(`packed weights: a segment at ${s.at} out of place`);
    end = s.at + s.bytes;
    if (s.kind === 'zeros' || s.kind === '128s') {
      out.fill(s.kind === 'zeros' ? 0 : 128, s.at, s.at + s.bytes);
      continue;
    }
    if (s.kind === 'raw') {
      out.set(packed.subarray(s.from, s.from + s.bytes), s.at);
      continue;
    }
    if (!(s.kind in PER_BLOCK)) throw new Error(`packed weights: unknown block kind ${s.kind}`);
    const length = (s.bytes / PER_BLOCK[s.kind]) * LAYOUT[s.kind.split('.')[0]][1];
    if (s.from + length > packed.length) throw new Error(`packed weights: the blocks file is too short`);
    const src = packed.subarray(s.from, s.from + length);
    if (s.kind in LAYOUT) unpackRows(s.kind, src, new Float32Array(out.buffer, s.at, s.bytes / 4));
    else blockParts(s.kind, src, out.subarray(s.at, s.at + s.bytes), s.rows);
  }
  return out;
}
