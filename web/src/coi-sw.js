// Cross-origin isolation on a static host that cannot send headers. onnxruntime-web runs WASM on several
// threads only in a cross-origin isolated page (SharedArrayBuffer), which takes two response headers:
// `python -m builder serve` sends them; where the host does not, app.mjs registers this service worker,
// which adds them to every response of this site, and reloads the page once. The site loads nothing
// from other origins, so requiring CORP/CORS of them (COEP) blocks nothing.
self.addEventListener('install', () => self.skipWaiting());
self.addEventListener('activate', (event) => event.waitUntil(self.clients.claim()));
self.addEventListener('fetch', (event) => {
  const { request } = event;
  if (request.cache === 'only-if-cached' && request.mode !== 'same-origin') return;
  event.respondWith(fetch(request).then((response) => {
    if (response.status === 0) return response;  // opaque: nothing to add
    const headers = new Headers(response.headers);
    headers.set('Cross-Origin-Opener-Policy', 'same-origin');
    headers.set('Cross-Origin-Embedder-Policy', 'require-corp');
    return new Response(response.body, { status: response.status, statusText: response.statusText, headers });
  }));
});
