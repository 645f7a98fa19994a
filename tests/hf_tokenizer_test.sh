#!/usr/bin/env bash
# Exactness of `pack --tokenizer hf` against Hugging Face's own implementation: the tokenizer.json
# files of Llama 3, Qwen3 and GPT-2 (byte-level) and of Llama 2, Gemma, Gemma 3 and a Gemini-family
# file (SentencePiece-style, byte fallback) that npm packages ship, over ~1.2 MB of generated mixed
# text with added-token strings in it (special ones plain text as pack's default, and matched for
# Qwen3, Llama 2 and Gemma 3 as with --special-tokens match), encoded by tokenizers.js
# (tests/hf_tokenizer_reference/reference.js) and by mpitrain (hf_tokenizer_exact); every id of
# every document must agree.
#
#   bash tests/hf_tokenizer_test.sh HF_TOKENIZER_EXACT
#   bash tests/hf_tokenizer_test.sh --installed   exit 0 when the npm packages are in the cache
#                                                 (scripts/test.sh then installs node without npm)
#
# The npm packages (exact versions: tests/hf_tokenizer_reference/package-lock.json) are installed
# once into $MPITRAIN_NPM_CACHE (default ~/.cache/mpitrain-npm), one directory per lock file, and
# reused. Without them and without the npm registry the test FAILS: it is never skipped.
set -euo pipefail

exact=${1:?usage: hf_tokenizer_test.sh HF_TOKENIZER_EXACT | --installed}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=jobs_lib.sh
. "$root/tests/jobs_lib.sh"
ref="$root/tests/hf_tokenizer_reference"
cache="${MPITRAIN_NPM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mpitrain-npm}"
fail() {
  echo "FAIL: $*"
  exit 1
}

# ---- the reference implementation, installed once -------------------------------------------------
key=$(sha256sum "$ref/package-lock.json" | cut -c1-16)
modules="$cache/hf_tokenizer_reference-$key"
if [ "$exact" = --installed ]; then [ -f "$modules/.complete" ]; exit; fi
command -v node >/dev/null || fail "node is needed (Debian: nodejs)"
if [ ! -f "$modules/.complete" ]; then
  command -v npm >/dev/null || fail "npm is needed to install the reference packages (Debian: npm)"
  echo "== installing the npm packages of $ref/package-lock.json into $modules"
  rm -rf "$modules.tmp"
  mkdir -p "$modules.tmp"
  cp "$ref/package.json" "$ref/package-lock.json" "$modules.tmp/"
  (cd "$modules.tmp" && timeout 600 npm ci --no-audit --no-fund --cache "$cache/npm-cache") ||
    fail "npm ci could not install the reference packages (needs the npm registry, or a filled $modules)"
  touch "$modules.tmp/.complete"
  rm -rf "$modules"
  mv "$modules.tmp" "$modules"
fi

# ---- reference ids, then mpitrain's ---------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/mpitrain-hf-tokenizer.XXXXXX")
trap 'rm -rf "$work"' EXIT
# Two processes at a time (CTest gives this test both cores: PROCESSORS 2; tests/jobs_lib.sh):
# tokenizers.js in two halves of the list, each writing the same corpus, then mpitrain's checks,
# each printed whole in the list's order.
start=$SECONDS
jobs_run 2 "$work" ref1 env NODE_PATH="$modules/node_modules" \
  node "$ref/reference.js" "$work" 1200000 llama3,gpt2,gemma,gemini,llama2-match
jobs_run 2 "$work" ref2 env NODE_PATH="$modules/node_modules" \
  node "$ref/reference.js" "$work" 1200000 qwen3,llama2,gemma3,qwen3-match,gemma3-match
jobs_wait
jobs_print "$work" ref1 ref2 || fail "reference.js"
echo "reference ids: $((SECONDS - start)) s"
names=(llama3 qwen3 gpt2 llama2 gemma gemma3 gemini qwen3-match llama2-match gemma3-match)
# shellcheck disable=SC2317  # run through jobs_run
check_one() {  # check_one NAME: mpitrain's ids against the reference's; prints PASS:/FAIL:
  local name=$1 tokenizer special corpus
  tokenizer=$(node -p "require('$work/$name.json').tokenizer")
  special=$(node -p "require('$work/$name.json').special_tokens")
  corpus="$work/corpus.jsonl"
  [ "$name" = gpt2 ] && corpus="$work/corpus-gpt2.jsonl"
  if "$exact" "$tokenizer" "$corpus" "$work/$name.ids.jsonl" "$special"; then
    echo "PASS: $name"
  else
    echo "FAIL: $name"
  fi
}
for name in "${names[@]}"; do
  jobs_run 2 "$work" "check-$name" check_one "$name"
done
jobs_wait
failed=0
for name in "${names[@]}"; do
  jobs_print "$work" "check-$name" || failed=1
  grep -q "^PASS: $name\$" "$work/check-$name.log" || failed=1
done
exit $failed
