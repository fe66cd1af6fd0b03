// The site's files in the page: every download with progress, every model file checked against the
// manifest's sha256 and kept in Cache Storage for the next visit (a second visit fetches no model bytes,
// and a rebuilt site's changed files are new keys); the WebAssembly runtime kept likewise.

import { PageError } from './errors.mjs';

/** The sha256 of bytes, as hex. */
export const hex = async (data) => [...new Uint8Array(await crypto.subtle.digest('SHA-256', data))]
  .map((b) => b.toString(16).padStart(2, '0')).join('');

// Model files stay in Cache Storage after a verified download, keyed by their sha256: a second visit
// fetches no model bytes, and a rebuilt site's changed files are new keys. Absent (an insecure origin,
// storage disabled), files are simply downloaded.
const CACHE = 'frozen-mtp-models';
const openCache = () => (globalThis.caches ? caches.open(CACHE).catch(() => null) : Promise.resolve(null));
const cacheKey = (url, sha256) => `${url.href.split('?')[0]}?sha256=${sha256}`;

/** Whether Cache Storage holds a model file (`url` and its sha256) or the runtime (its key, no sha256). */
export async function isCached(url, sha256 = null) {
  const cache = await openCache();
  return !!await cache?.match(sha256 ? cacheKey(url, sha256) : String(url)).catch(() => null);
}

/**
 * A model file: from Cache Storage when it holds this very file (its sha256 checked again), else
 * downloaded, checked and stored.
 */
export async function fetchModelFile(url, { sha256, bytes, onBytes } = {}) {
  const cache = await openCache();
  const hit = await cache?.match(cacheKey(url, sha256)).catch(() => null);
  if (hit) {
    const data = new Uint8Array(await hit.arrayBuffer());
    if (await hex(data) === sha256) {
      onBytes?.(data.length);
      return data;
    }
    await cache.delete(cacheKey(url, sha256));  // damaged in storage: download it again
  }
  const data = await fetchBytes(url, { sha256, bytes, onBytes });
  await cache?.put(cacheKey(url, sha256), new Response(data)).catch(() => {});  // e.g. over quota: not kept
  return data;
}

/**
 * The WebAssembly runtime of the onnxruntime-web build in use (14.2 or 26.8 MB, the largest file after the
 * base's weights), kept in Cache Storage under its sha256 like the model files and checked against it on
 * every visit (the site manifest's `runtimes`), with the same progress bar; handed to
 * onnxruntime as `env.wasm.wasmBinary`, so that it does not fetch it again.
 */
export async function fetchRuntime({ url, sha256, bytes }, onProgress) {
  const cache = await openCache();
  const key = cacheKey(url, sha256);
  const hit = await cache?.match(key).catch(() => null);
  if (hit) {
    const data = new Uint8Array(await hit.arrayBuffer());
    if (await hex(data) === sha256) return data;
    await cache.delete(key);  // damaged in storage: download it again
  }
  let loaded = 0;
  const data = await fetchBytes(url, { sha256, bytes,
    onBytes: (n, total) => onProgress?.(loaded += n, total, 'the WebAssembly runtime') });
  onProgress?.(data.length, data.length, 'the WebAssembly runtime');  // done, also where no total was known
  if (cache) {
    for (const old of await cache.keys()) if (old.url.startsWith(`${url.href}?`) && old.url !== key) await cache.delete(old);
    await cache.put(key, new Response(data)).catch(() => {});
  }
  return data;
}

/** Drops cached model files the manifest no longer lists (a rebuilt site's old weights). */
export async function pruneCache(modelsUrl, manifest) {
  const cache = await openCache();
  if (!cache) return;
  const keep = new Set(Object.entries(manifest.files).map(([f, m]) => cacheKey(new URL(f, modelsUrl), m.sha256)));
  for (const request of await cache.keys()) {
    if (request.url.startsWith(modelsUrl.href) && !keep.has(request.url)) await cache.delete(request);
  }
}

/**
 * Fetches a file of the site, reporting bytes as they arrive (with the size the server announced, or 0
 * when unknown); checks its sha256 when one is given.
 */
export async function fetchBytes(url, { sha256, bytes, onBytes } = {}) {
  let response;
  try {
    response = await fetch(url);
  } catch (e) {
    throw new PageError(`could not download ${url} (${e.message})`);
  }
  if (response.status === 404) throw new PageError(`${url} is missing from the site (HTTP 404): rebuild the site`);
  if (!response.ok) throw new PageError(`could not download ${url}: HTTP ${response.status} ${response.statusText}`);
  // a gzip-encoded response announces its encoded size; the bytes read here are decoded: no total then
  const total = response.headers.get('content-encoding') ? 0 : Number(response.headers.get('content-length')) || 0;
  const reader = response.body.getReader();
  const chunks = [];
  for (let got; !(got = await reader.read()).done;) {
    chunks.push(got.value);
    onBytes?.(got.value.length, total);
  }
  const data = new Uint8Array(chunks.reduce((n, c) => n + c.length, 0));
  chunks.reduce((at, c) => { data.set(c, at); return at + c.length; }, 0);
  if (sha256) {
    const digest = await hex(data);
    if (digest !== sha256) {
      throw new PageError(`${url} is altered or truncated: ${data.length} bytes with sha256 ${digest.slice(0, 16)}.., ` +
        `the manifest says ${bytes} bytes with sha256 ${sha256.slice(0, 16)}..`);
    }
  }
  return data;
}
