// A Hugging Face BPE tokenizer.json, encoding as the `tokenizers` library does with
// add_special_tokens=False. Two kinds:
//  - byte-level (GPT-2, Llama 3, Qwen2/2.5/3 and their kin): normalizer (none or NFC) ->
//    pre_tokenizer (Split steps with Oniguruma-style regexes, then ByteLevel) -> BPE model (vocab,
//    merges in either format, ignore_merges);
//  - SentencePiece-style (model.byte_fallback: Llama 2, Mistral, Gemma, Gemma 3): normalizer
//    (Prepend and Replace, e.g. "▁" before the text and every space as "▁"; NFC) -> no
//    pre-tokenizer (or a Split that cannot match the normalized text: Gemma 3's on " ") -> BPE over
//    the text's characters, a character that is no token as its bytes' <0xXX> tokens, else the
//    unknown token (fuse_unk).
// Before all that, as the library's AddedVocabulary does, the added_tokens written in the text are
// cut out and become their ids, the text between them going through the steps above piece by
// piece: the non-special ones always (Gemma's runs of newlines and spaces, HTML tags; Qwen3's
// <think>), with their single_word, lstrip, rstrip and normalized flags; the special ones
// (<|endoftext|>, <|im_start|>, <bos>) only with SpecialTokens::match — by default they are plain
// text (docs/pack.md, "Tokenizers"), so that only the document separator that pack puts between
// documents is a special id.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mpitrain/bpe.h"  // InvalidUtf8

namespace mpitrain {

// Whether special added tokens written in the text are matched (Hugging Face's encode) or are
// plain text (mpitrain's default; the library's encode_special_tokens=True).
enum class SpecialTokens { text, match };

class HfTokenizer {
 public:
  // Loads and checks `path`. A file this cannot reproduce exactly, or a malformed one, is one
  // UsageError naming the file and the key: "tokenizer.json: model.merges[12]: 'Ġa' names no
  // token", "tokenizer.json: pre_tokenizer.type: the Metaspace pre-tokenizer ... is not supported".
  explicit HfTokenizer(const std::string& path);
  ~HfTokenizer();
  HfTokenizer(HfTokenizer&&) noexcept;
  HfTokenizer& operator=(HfTokenizer&&) noexcept;

  int64_t vocab_size() const;               // the largest id (vocab or added token) + 1
  const std::string& sha256() const;        // of the file's bytes, lower-case hex
  const std::string& path() const;

  // The token that starts every document, from the file: the special token the post_processor's
  // TemplateProcessing puts first (Llama 3's BOS), else the added token "<|begin_of_text|>",
  // "<|endoftext|>" or "<|end_of_text|>", in that order. Empty when the file has none.
  std::optional<uint32_t> separator() const;
  // The unknown token a SentencePiece-style file falls back to (model.unk_token), if it has one.
  // Text that needs it does not decode back to itself.
  std::optional<uint32_t> unknown_token() const;
  // Whether a ByteLevel step puts a space before each piece that does not start with one
  // (add_prefix_space, which a ByteLevel step must state). decode() keeps those spaces, as Hugging
  // Face's ByteLevel decoder does.
  bool adds_prefix_space() const;
  // Whether `id` is one of the file's added_tokens (special or not): what a document separator
  // must be (pack --eot).
  bool is_added_token(uint32_t id) const;
  // Special added tokens in the text: plain text (the default) or matched (pack --special-tokens).
  void set_special_tokens(SpecialTokens mode);
  SpecialTokens special_tokens() const;
  // The id of a vocabulary entry or added token, written as in the file.
  std::optional<uint32_t> token_id(const std::string& token) const;

  // The text as the tokenizer sees it: the file's normalizers applied (NFC, Prepend, Replace) —
  // to each piece between the added tokens that encode() matches, on its own, and each such token
  // as decode() writes it (the whitespace its lstrip or rstrip takes is gone). Without added
  // tokens in the text: the normalizers applied to the whole text.
  // Throws InvalidUtf8 for text that is not UTF-8.
  std::string normalize(std::string_view text) const;

  // Appends the ids of `text`. Throws InvalidUtf8 when `text` is not UTF-8.
  void encode(std::string_view text, std::vector<uint32_t>& out);
  std::vector<uint32_t> encode(std::string_view text);

  // The bytes of `ids` as the normalized text (the ByteLevel decoder without the final lossy UTF-8
  // conversion): each token's characters mapped back to bytes (byte-level), or the token as
  // written with each <0xXX> token as its byte (SentencePiece-style); an added token's content as
  // it is. encode then decode gives normalize(text), with the spaces adds_prefix_space() puts
  // before pieces. An id that names no token is a UsageError.
  std::string decode(const std::vector<uint32_t>& ids) const;
  // Text for people: decode() and then the file's decoder steps that act on text (a
  // SentencePiece-style file's Replace "▁" -> " " and Strip of the leading space; byte-level files
  // need none).
  std::string detokenize(const std::vector<uint32_t>& ids) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mpitrain
