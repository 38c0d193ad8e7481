// Direct fp64 implementation of the contract's math (spec/contract.md §2) on dense, unpaged arrays of one
// request, used to check the CPU oracle and, through it, every other path. Keys are given as dense row-major
// [S, D] arrays of one request (position j = row j); queries as one token's rows.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dsacp::ref {

// s(j) = sum_h w[h] * relu(q[h, :] . keys[j, :]) for j in [0, num_keys), in fp64.
//   q: [Hi, Di], w: [Hi], keys: [>= num_keys, Di].
std::vector<double> index_scores(std::span<const float> q, std::span<const float> w, std::span<const float> keys,
                                 int32_t hi, int32_t di, int64_t num_keys);

// The canonical top-k row: the K largest scores (ties to the lower position, NaN below everything), the
// chosen positions ascending, then -1 up to K. Fewer than K scores: all of them.
std::vector<int32_t> canonical_topk(std::span<const double> scores, int32_t k);

// Checks a top-k row against fp64 scores, allowing near ties at the selection boundary: the row must be
// ascending, front-packed, -1 padded, hold min(K, S) distinct positions, and every chosen score must be
// >= every unchosen score up to `tol` (relative to the largest |score|). Returns "" when it holds, else why.
std::string check_topk_row(std::span<const int32_t> row, std::span<const double> scores, int32_t k, double tol = 1e-5);

// Attention of one query head over chosen positions (entries < 0 end the list; they are front-packed):
//   l(j) = scale * (q_nope . latent[j] + q_rope . rope[j]); out = softmax(l) @ latent; lse = ln sum exp l.
// No chosen key: out = 0, lse = -inf.
struct AttentionResult {
  std::vector<double> out;  // [Dl]
  double lse = 0.0;
};
AttentionResult attention(std::span<const float> q_nope, std::span<const float> q_rope, std::span<const float> latent,
                          std::span<const float> rope, std::span<const int32_t> chosen, double scale, int32_t dl,
                          int32_t dr);

// The value of an e4m3 (fn) code from its definition: bias 7, subnormals at exponent 0, S.1111.111 = NaN.
double e4m3_value(int code);
// The nearest finite e4m3 code to x by exhaustive search over the codes: a tie goes to the code with an even
// mantissa; |x| >= 448 saturates to +-448; NaN -> 0x7f with the sign; -0 keeps its sign.
uint8_t brute_e4m3(float x);

// ||got - want|| / ||want|| (0 when both are zero; +inf when want is zero and got is not, or on NaN).
double rel_norm_error(std::span<const float> got, std::span<const double> want);

}  // namespace dsacp::ref
