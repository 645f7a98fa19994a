// What a run shows: TensorBoard records against bytes Google's protobuf serializer and the crc32c
// package produced for the same events (tests/tensorboard_read.py's message declarations), and
// the MFU arithmetic. tests/observe_test.sh checks a real run's files end to end.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <unistd.h>

#include "mpitrain/mfu.h"
#include "mpitrain/tensorboard.h"

namespace mpitrain {
namespace {

std::string unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) out += {digits[c >> 4], digits[c & 15]};
  return out;
}

TEST(TensorBoard, Crc32cOfTheStandardCheckString) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C (Castagnoli) check value
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720, B.4: 32 bytes of zeros
}

// Expected bytes: python3-protobuf's SerializeToString of the same Event (declared as in
// TensorFlow's event.proto), framed with python3-crc32c (tests/tensorboard_read.py's masked()).
TEST(TensorBoard, EventsEqualGooglesSerialization) {
  EXPECT_EQ(hex(scalars_event(1.5, 7, {{"loss/train", 2.5}})),
            "09000000000000f83f10072a130a110a0a6c6f73732f747261696e1500002040");
  EXPECT_EQ(hex(session_start_event(1.5, 300)), "09000000000000f83f10ac0232020801");
  EXPECT_EQ(hex(file_version_event(1.5)), "09000000000000f83f1a0d627261696e2e4576656e743a32");
}

TEST(TensorBoard, RecordFramingEqualsKnownBytes) {
  const std::string payload = unhex("09000000000000f83f10072a130a110a0a6c6f73732f747261696e1500002040");
  EXPECT_EQ(hex(tf_record(payload)),
            "200000000000000029eda95009000000000000f83f10072a130a110a0a6c6f73732f747261696e15000020402c056691");
}

TEST(TensorBoard, WriterFileIsRecordsWithValidCrcs) {
  const auto dir = std::filesystem::temp_directory_path() / ("mpt-tb-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::string path;
  {
    TensorBoardWriter w(dir.string(), "testhost", "log.tensorboard");
    path = w.path();
    w.restart(11);
    w.scalars(12, {{"loss/train", 3.25}, {"optim/lr", 1e-3}});
  }
  EXPECT_NE(path.find("/events.out.tfevents."), std::string::npos) << path;
  EXPECT_NE(path.find(".testhost."), std::string::npos) << path;
  std::ifstream in(path, std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Walk the records: length, its masked CRC, payload, the payload's masked CRC.
  size_t at = 0;
  std::vector<std::string> payloads;
  while (at < raw.size()) {
    ASSERT_LE(at + 12, raw.size());
    uint64_t length = 0;
    uint32_t length_crc = 0, payload_crc = 0;
    std::memcpy(&length, raw.data() + at, 8);
    std::memcpy(&length_crc, raw.data() + at + 8, 4);
    EXPECT_EQ(length_crc, masked_crc32c(raw.data() + at, 8));
    ASSERT_LE(at + 16 + length, raw.size());
    payloads.push_back(raw.substr(at + 12, length));
    std::memcpy(&payload_crc, raw.data() + at + 12 + length, 4);
    EXPECT_EQ(payload_crc, masked_crc32c(payloads.back().data(), length));
    at += 16 + length;
  }
  ASSERT_EQ(payloads.size(), 3u);
  EXPECT_NE(payloads[0].find("brain.Event:2"), std::string::npos);
  EXPECT_EQ(payloads[1].substr(9), unhex("100b32020801"));  // after wall_time: step 11, SessionLog START
  EXPECT_NE(payloads[2].find("optim/lr"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(TensorBoard, UnwritableDirectoryNamesTheKey) {
  try {
    TensorBoardWriter w("/proc/mpitrain-no-such-dir", "h", "log.tensorboard");
    FAIL() << "expected a UsageError";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("log.tensorboard: cannot write '/proc/mpitrain-no-such-dir/"),
              std::string::npos)
        << e.what();
  }
}

// ---- MFU ---------------------------------------------------------------------------------------

TEST(Mfu, FlopsPerTokenIsSixNPlusAttention) {
  // GPT-2 124M (vocab 50257, T 1024): N = 124,439,808 parameters, 786,432 of them wpe.
  const double f = model_flops_per_token(124439808, 1024 * 768, 12, 768, 1024);
  EXPECT_DOUBLE_EQ(f, 6.0 * (124439808 - 786432) + 12.0 * 12 * 768 * 1024);
  EXPECT_NEAR(f / 1e9, 0.8552, 1e-4);  // ~0.86 GFLOPs per token
}

TEST(Mfu, KnownPeaksByCudaName) {
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA H100 80GB HBM3", "bf16"), 989.4);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA H100 80GB HBM3", "fp32"), 66.9);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA H100 PCIe", "fp16"), 756.0);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA H100 NVL", "bf16"), 835.0);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA H200", "bf16"), 989.4);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32"), 19.5);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA L40S", "bf16"), 362.1);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA L40", "bf16"), 181.0);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA GeForce RTX 4090", "bf16"), 0.0);  // not in the table
  EXPECT_DOUBLE_EQ(known_peak_tflops("", "bf16"), 0.0);                         // the CPU
}

}  // namespace
}  // namespace mpitrain
