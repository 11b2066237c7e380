// Suffix trees for suffix decoding (arXiv 2411.04975), used by tachyllm/spec_decode/suffix_tree.py.
//
// A tree holds every substring of at most max_depth tokens of the texts put in, as a trie whose
// nodes count their occurrences. Appending a token extends the at most max_depth - 1 suffixes that
// end at the previous token (O(max_depth), never a rebuild); removing a text takes its counts away
// and deletes the nodes left with none, which is how the tree of finished outputs stays bounded.
// A draft follows a suffix of the context found in the tree, then the most frequent continuation
// token by token; every match length is tried and the draft with the most expected accepted tokens
// wins.
//
// Nodes live in one vector and refer to each other by 32-bit index (8 bytes a child with its token,
// where a map entry would take several times that); deleted nodes are reused.
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

using Tokens = std::vector<int64_t>;
// A draft: its tokens, the length of the match it follows, its expected number of accepted tokens.
using Candidate = std::tuple<Tokens, int64_t, double>;

struct Child {
  int32_t token;  // token ids are checked to fit when put in
  int32_t node;
};

struct Node {
  int64_t count = 0;            // occurrences of the path from the root to here
  int64_t continued = 0;        // of those, how many are followed by another token (the children's counts)
  std::vector<Child> children;  // by token, ascending
};

class SuffixTree {
 public:
  explicit SuffixTree(int64_t max_depth) : max_depth_(max_depth) {
    if (max_depth < 1)
      throw std::invalid_argument("SuffixTree: max_depth must be >= 1, got " + std::to_string(max_depth));
    nodes_.emplace_back();
  }

  int64_t max_depth() const { return max_depth_; }
  int64_t num_nodes() const { return num_nodes_; }
  int64_t num_tokens() const { return num_tokens_; }

  // Begins another text in the same tree: no substring spans the texts' boundary.
  void start_text() {
    open_.clear();
    recent_.clear();
  }

  void extend(const Tokens& tokens) {
    std::vector<int32_t> extended;
    extended.reserve(max_depth_);
    for (int64_t token : tokens) {
      if (token < 0 || token > INT32_MAX)
        throw std::invalid_argument("SuffixTree.extend: bad token id " + std::to_string(token));
      extended.clear();
      open_.push_back(kRoot);  // the empty suffix, shortest last
      for (int32_t node : open_) {
        int32_t child = child_or_new(node, token);
        nodes_[child].count += 1;
        nodes_[node].continued += 1;
        extended.push_back(child);
      }
      num_tokens_ += 1;
      recent_.push_back(token);
      // The suffixes that reached max_depth are extended no further.
      const size_t keep = std::min<size_t>(extended.size(), static_cast<size_t>(max_depth_ - 1));
      open_.assign(extended.end() - keep, extended.end());
    }
    // Trimmed now and then rather than per token: amortized O(1).
    if (recent_.size() > static_cast<size_t>(2 * max_depth_))
      recent_.erase(recent_.begin(), recent_.end() - max_depth_);
  }

  // The last max_depth tokens of the text since start_text(): the context a draft follows.
  Tokens recent() const {
    const size_t keep = std::min(recent_.size(), static_cast<size_t>(max_depth_));
    return Tokens(recent_.end() - keep, recent_.end());
  }

  // Takes away the counts that extend(tokens) added as a text of its own (after start_text()).
  void remove(const Tokens& tokens) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    for (int64_t start = 0; start < n; ++start) {  // checked first, so that a wrong text changes nothing
      int32_t node = kRoot;
      for (int64_t i = start; i < std::min(n, start + max_depth_); ++i) {
        node = find_child(node, tokens[i]);
        if (node < 0) throw std::invalid_argument("SuffixTree.remove: the text was never put in this tree");
      }
    }
    for (int64_t start = 0; start < n; ++start) {
      int32_t node = kRoot;
      for (int64_t i = start; i < std::min(n, start + max_depth_); ++i) {
        const int32_t child = find_child(node, tokens[i]);
        nodes_[child].count -= 1;
        nodes_[node].continued -= 1;
        if (nodes_[child].count == 0) {
          auto& siblings = nodes_[node].children;
          siblings.erase(child_position(node, tokens[i]));
          release(child);
          break;
        }
        node = child;
      }
    }
  }

  // The best-scored draft to follow context over every match length: for each suffix of context in
  // the tree (at most max_depth - 1 tokens, so that a token can follow), the most frequent child
  // token by token while the probability of the draft so far stays at least min_token_prob, at most
  // max_spec_factor times the match length (the paper's adaptive length: a long match is evidence
  // that the text repeats) and within the tree's depth. The longer match wins a tie.
  Candidate speculate(const Tokens& context, int64_t max_tokens, double max_spec_factor, double min_token_prob) const {
    const int64_t n = static_cast<int64_t>(context.size());
    std::vector<int32_t> matches;  // matches[L - 1]: the node of context's last L tokens
    for (int64_t length = 1; length <= std::min(max_depth_ - 1, n); ++length) {
      int32_t node = kRoot;
      for (int64_t i = n - length; i < n && node >= 0; ++i) node = find_child(node, context[i]);
      if (node < 0) break;  // a longer suffix contains this one, so it is not in the tree either
      matches.push_back(node);
    }
    return best_draft(matches, max_tokens, max_spec_factor, min_token_prob);
  }

  // speculate() with the tree's own text since start_text() as the context, at no lookup cost: the
  // nodes of that text's suffixes are the ones the next token would extend.
  Candidate speculate_own(int64_t max_tokens, double max_spec_factor, double min_token_prob) const {
    const std::vector<int32_t> matches(open_.rbegin(), open_.rend());
    return best_draft(matches, max_tokens, max_spec_factor, min_token_prob);
  }

  // (count, continued) of the node that path leads to, or nothing where the tree lacks it.
  std::optional<std::tuple<int64_t, int64_t>> lookup(const Tokens& path) const {
    int32_t node = kRoot;
    for (int64_t token : path) {
      node = find_child(node, token);
      if (node < 0) return std::nullopt;
    }
    return std::make_tuple(nodes_[node].count, nodes_[node].continued);
  }

  // Every node but the root as (path, count, continued), paths in lexicographic order: a tree's
  // whole content, comparable between trees.
  std::vector<std::tuple<Tokens, int64_t, int64_t>> entries() const {
    std::vector<std::tuple<Tokens, int64_t, int64_t>> out;
    Tokens path;
    collect(kRoot, path, out);
    return out;
  }

 private:
  static constexpr int32_t kRoot = 0;

  int64_t max_depth_;
  int64_t num_nodes_ = 1;
  int64_t num_tokens_ = 0;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;  // deleted nodes' slots
  // The nodes of the suffixes of the text so far shorter than max_depth (those the next token
  // extends), longest first.
  std::vector<int32_t> open_;
  Tokens recent_;  // the text's last tokens since start_text(): at least max_depth of them where it has them

  std::vector<Child>::const_iterator child_position(int32_t node, int64_t token) const {
    const auto& children = nodes_[node].children;
    return std::lower_bound(children.begin(), children.end(), token,
                            [](const Child& c, int64_t t) { return c.token < t; });
  }

  int32_t find_child(int32_t node, int64_t token) const {
    auto it = child_position(node, token);
    return it != nodes_[node].children.end() && it->token == token ? it->node : -1;
  }

  int32_t child_or_new(int32_t node, int64_t token) {
    auto it = child_position(node, token);
    if (it != nodes_[node].children.end() && it->token == token) return it->node;
    const auto offset = it - nodes_[node].children.cbegin();
    int32_t fresh;
    if (free_.empty()) {
      if (nodes_.size() >= static_cast<size_t>(INT32_MAX)) throw std::length_error("SuffixTree: too many nodes");
      fresh = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();  // may move nodes_: positions are taken again below
    } else {
      fresh = free_.back();
      free_.pop_back();
    }
    auto& children = nodes_[node].children;
    children.insert(children.begin() + offset, Child{static_cast<int32_t>(token), fresh});
    num_nodes_ += 1;
    return fresh;
  }

  void release(int32_t node) {
    std::vector<int32_t> pending{node};
    while (!pending.empty()) {
      const int32_t current = pending.back();
      pending.pop_back();
      for (const Child& c : nodes_[current].children) pending.push_back(c.node);
      nodes_[current] = Node();  // gives the children's storage back
      free_.push_back(current);
      num_nodes_ -= 1;
    }
  }

  Candidate best_draft(const std::vector<int32_t>& matches, int64_t max_tokens, double max_spec_factor,
                       double min_token_prob) const {
    Candidate best{Tokens{}, 0, 0.0};
    for (size_t i = 0; i < matches.size(); ++i) {
      const auto length = static_cast<int64_t>(i + 1);
      const int64_t limit = std::min(max_tokens, static_cast<int64_t>(max_spec_factor * static_cast<double>(length)));
      Candidate candidate = follow(matches[i], length, limit, min_token_prob);
      if (!std::get<0>(candidate).empty() && std::get<2>(candidate) >= std::get<2>(best)) best = std::move(candidate);
    }
    return best;
  }

  Candidate follow(int32_t node, int64_t match_length, int64_t limit, double min_token_prob) const {
    Tokens draft;
    double reach = 1.0, score = 0.0;
    while (static_cast<int64_t>(draft.size()) < limit && nodes_[node].continued > 0) {
      const Child* most = nullptr;  // the most frequent child; the smallest token on a tie
      for (const Child& c : nodes_[node].children)
        if (most == nullptr || nodes_[c.node].count > nodes_[most->node].count) most = &c;
      reach *= static_cast<double>(nodes_[most->node].count) / static_cast<double>(nodes_[node].continued);
      if (reach < min_token_prob) break;
      draft.push_back(most->token);
      score += reach;
      node = most->node;
    }
    return {std::move(draft), match_length, score};
  }

  void collect(int32_t node, Tokens& path, std::vector<std::tuple<Tokens, int64_t, int64_t>>& out) const {
    for (const Child& c : nodes_[node].children) {
      path.push_back(c.token);
      out.emplace_back(path, nodes_[c.node].count, nodes_[c.node].continued);
      collect(c.node, path, out);
      path.pop_back();
    }
  }
};

// One step's drafts in one call (a few native calls and a dozen Python ones per row and step were a
// share of a large batch's step): row i's tree is first extended by new_tokens[i], the tokens
// accepted since its last proposal; its draft is then the better scored of its own and the one
// shared[i] (the tree of finished outputs its row may draft from; None: none) gives for the last
// max_depth tokens of its text, its own on a tie.
std::vector<Tokens> propose(const std::vector<SuffixTree*>& own, const std::vector<Tokens>& new_tokens,
                            const std::vector<SuffixTree*>& shared, const std::vector<int64_t>& max_tokens,
                            double max_spec_factor, double min_token_prob) {
  const size_t rows = own.size();
  if (new_tokens.size() != rows || shared.size() != rows || max_tokens.size() != rows)
    throw std::invalid_argument("suffix_propose: own, new_tokens, shared and max_tokens must have one entry per row");
  std::vector<Tokens> drafts;
  drafts.reserve(rows);
  for (size_t i = 0; i < rows; ++i) {
    if (own[i] == nullptr) throw std::invalid_argument("suffix_propose: every row needs its own tree");
    own[i]->extend(new_tokens[i]);
    Candidate best = own[i]->speculate_own(max_tokens[i], max_spec_factor, min_token_prob);
    if (shared[i] != nullptr) {
      Candidate other = shared[i]->speculate(own[i]->recent(), max_tokens[i], max_spec_factor, min_token_prob);
      if (std::get<2>(other) > std::get<2>(best)) best = std::move(other);
    }
    drafts.push_back(std::move(std::get<0>(best)));
  }
  return drafts;
}

}  // namespace

void register_suffix_tree(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<SuffixTree>(m, "SuffixTree", "suffix decoding's token trie (kernels/csrc/suffix_tree.cpp)")
      .def(py::init<int64_t>(), py::arg("max_depth"))
      .def_property_readonly("max_depth", &SuffixTree::max_depth)
      .def_property_readonly("num_nodes", &SuffixTree::num_nodes)
      .def_property_readonly("num_tokens", &SuffixTree::num_tokens)
      .def("start_text", &SuffixTree::start_text)
      .def("extend", &SuffixTree::extend, py::arg("token_ids"))
      .def("remove", &SuffixTree::remove, py::arg("token_ids"))
      .def("speculate", &SuffixTree::speculate, py::arg("context"), py::arg("max_tokens"), py::arg("max_spec_factor"),
           py::arg("min_token_prob"))
      .def("speculate_own", &SuffixTree::speculate_own, py::arg("max_tokens"), py::arg("max_spec_factor"),
           py::arg("min_token_prob"))
      .def("lookup", &SuffixTree::lookup, py::arg("path"))
      .def("recent", &SuffixTree::recent)
      .def("entries", &SuffixTree::entries);
  m.def("suffix_propose", &propose, py::arg("own"), py::arg("new_tokens"), py::arg("shared"), py::arg("max_tokens"),
        py::arg("max_spec_factor"), py::arg("min_token_prob"));
}
