// The task APIs' page (api.html): it uses Summarizer, Proofreader, Writer and LanguageModel from globalThis
// exactly as a site coding against the web platform would, here provided by ai.mjs. Text only reaches the page
// through textContent.

import './ai.mjs';

const $ = (id) => document.getElementById(id);
const { apis } = globalThis.frozenMTPAI;
$('api-in-use').textContent = Object.entries(apis)
  .map(([name, { implementation, why }]) => `${name}: ${implementation === 'native' ? "the browser's own" : `this site's models (${why})`}`)
  .join(' · ');

function showError(e) {
  $('api-message').textContent = `${e.name}: ${e.message}`;
  $('api-message').hidden = false;
}

/** Each API's instance, created on first use (from the click: a first download needs a user gesture). */
const created = {};
function model(name, options = {}) {
  created[name] ??= globalThis[name].create({
    ...options,
    monitor(m) {
      m.addEventListener('downloadprogress', (e) => {
        $('api-progress').hidden = e.loaded === 1;
        $('api-progress').value = e.loaded;
      });
    },
  });
  created[name].catch(() => { delete created[name]; });
  return created[name];
}

/** Runs a button's action with the button disabled, errors shown. */
function onClick(id, action) {
  $(id).addEventListener('click', async () => {
    $(id).disabled = true;
    $('api-message').hidden = true;
    try {
      await action();
    } catch (e) {
      if (e.name !== 'AbortError') showError(e);
    } finally {
      $(id).disabled = false;
    }
  });
}

/** Appends a stream's chunks to an element as they arrive. */
async function streamInto(stream, element) {
  element.textContent = '';
  for await (const chunk of stream) element.textContent += chunk;
}

onClick('summarize', async () => {
  const summarizer = await model('Summarizer', { type: 'tldr', length: 'short', format: 'plain-text' });
  await streamInto(summarizer.summarizeStreaming($('summarize-input').value), $('summary'));
});

onClick('proofread', async () => {
  const proofreader = await model('Proofreader');
  const input = $('proofread-input').value;
  const { correctedInput, corrections } = await proofreader.proofread(input);
  const out = $('proofread-output');
  out.replaceChildren();
  let at = 0;
  for (const c of corrections) {  // the input with each corrected span marked
    const mark = document.createElement('mark');
    mark.textContent = c.correction;
    mark.title = `was: ${input.substring(c.startIndex, c.endIndex)}`;
    out.append(input.substring(at, c.startIndex), mark);
    at = c.endIndex;
  }
  out.append(input.substring(at));
  if (!corrections.length) out.textContent = `No corrections: ${correctedInput}`;
});

onClick('reply', async () => {
  const writer = await model('Writer', { tone: 'neutral', length: 'short' });
  await streamInto(writer.writeStreaming($('reply-input').value, { context: $('reply-context').value }), $('reply-output'));
});

let chatStop = null;
onClick('send', async () => {
  const session = await model('LanguageModel', {
    initialPrompts: [{ role: 'system', content: 'You are a helpful assistant. Answer briefly.' }],
  });
  const line = (cls, text) => {
    const p = document.createElement('p');
    p.className = cls;
    p.textContent = text;
    $('chat').append(p);
    return p;
  };
  line('user', $('chat-input').value);
  chatStop = new AbortController();
  await streamInto(session.promptStreaming($('chat-input').value, { signal: chatStop.signal }), line('assistant', ''));
  $('context-usage').textContent = `${session.contextUsage} of ${session.contextWindow} tokens of context used.`;
});
$('stop-api').addEventListener('click', () => chatStop?.abort());
