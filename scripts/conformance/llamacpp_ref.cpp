// llama.cpp's answers for the conformance fixtures (issue 33): token ids, teacher-forced
// top-k log-probabilities, and built-in chat template renderings, written as JSON.
//
// Built against a llama.cpp build by scripts/conformance/make_references.sh; never run by
// the test suite, which reads the committed fixtures.
//
//   llamacpp_ref tokenize MODEL TEXT_FILE                    -> {"ids": [...]}
//   llamacpp_ref logits MODEL REQUEST.json                   -> {"positions": [...], "top": [...]}
//       REQUEST: {"ids": [...], "positions": [...], "top_k": 5, "threads": 2}
//       position p: the distribution after ids[0..=p], i.e. the prediction of ids[p + 1].
//   llamacpp_ref greedy MODEL REQUEST.json                   -> {"tokens": [...], "top": [...]}
//       REQUEST: {"ids": prompt, "n_predict": 32, "top_k": 5, "threads": 2}
//   llamacpp_ref chat TEMPLATE_NAME MESSAGES.json            -> {"with_prompt": s, "without": s}

#include "llama.h"
#include "nlohmann/json.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

using json = nlohmann::ordered_json;

static std::string read_file(const char * path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(1);
    }
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

static llama_model * load(const char * path) {
    llama_model_params mp = llama_model_default_params();
    llama_model * m = llama_model_load_from_file(path, mp);
    if (!m) {
        fprintf(stderr, "cannot load %s\n", path);
        exit(1);
    }
    return m;
}

static int cmd_tokenize(const char * model_path, const char * text_path) {
    llama_model * model = load(model_path);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::string text = read_file(text_path);
    std::vector<llama_token> ids(text.size() + 16);
    // No BOS, no special-token parsing: the raw text's ids, as llama-tokenize --no-bos
    // --no-parse-special gives them.
    int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), false, false);
    if (n < 0) {
        fprintf(stderr, "tokenize failed\n");
        return 1;
    }
    ids.resize(n);
    std::cout << json{{"ids", ids}}.dump() << "\n";
    llama_model_free(model);
    return 0;
}

// Top-k (id, log-probability) of one logits row, log-softmax in double precision.
static json top_k(const float * logits, int n_vocab, int k) {
    double mx = -INFINITY;
    for (int i = 0; i < n_vocab; i++) mx = std::max(mx, (double) logits[i]);
    double sum = 0.0;
    for (int i = 0; i < n_vocab; i++) sum += std::exp((double) logits[i] - mx);
    const double lse = mx + std::log(sum);
    std::vector<int> idx(n_vocab);
    for (int i = 0; i < n_vocab; i++) idx[i] = i;
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int a, int b) { return logits[a] > logits[b]; });
    json out = json::array();
    for (int j = 0; j < k; j++) {
        out.push_back(json::array({idx[j], (double) logits[idx[j]] - lse}));
    }
    return out;
}

static int cmd_logits(const char * model_path, const char * request_path) {
    json req = json::parse(read_file(request_path));
    std::vector<llama_token> ids = req["ids"].get<std::vector<llama_token>>();
    std::vector<int> positions = req["positions"].get<std::vector<int>>();
    const int k = req.value("top_k", 5);
    const int threads = req.value("threads", 2);
    std::vector<char> wanted(ids.size(), 0);
    for (int p : positions) {
        if (p < 0 || p >= (int) ids.size()) {
            fprintf(stderr, "position %d outside the %zu ids\n", p, ids.size());
            return 1;
        }
        wanted[p] = 1;
    }
    llama_model * model = load(model_path);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    const int ub = 512;
    cp.n_ctx = (uint32_t) ((ids.size() + ub - 1) / ub * ub);
    cp.n_batch = ub;
    cp.n_ubatch = ub;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot create a context\n");
        return 1;
    }
    json top = json::array();
    llama_batch batch = llama_batch_init(ub, 0, 1);
    for (size_t start = 0; start < ids.size(); start += ub) {
        const size_t end = std::min(ids.size(), start + ub);
        batch.n_tokens = 0;
        for (size_t i = start; i < end; i++) {
            const int j = batch.n_tokens++;
            batch.token[j] = ids[i];
            batch.pos[j] = (llama_pos) i;
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = wanted[i];
        }
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "decode failed at %zu\n", start);
            return 1;
        }
        for (size_t i = start; i < end; i++) {
            if (wanted[i]) {
                top.push_back(top_k(llama_get_logits_ith(ctx, (int32_t) (i - start)), n_vocab, k));
            }
        }
        fprintf(stderr, "\r%zu / %zu tokens", end, ids.size());
    }
    fprintf(stderr, "\n");
    std::vector<int> sorted;
    for (size_t i = 0; i < ids.size(); i++) if (wanted[i]) sorted.push_back((int) i);
    std::cout << json{{"positions", sorted}, {"top", top}}.dump() << "\n";
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

// Greedy decoding after a prompt, one token per llama_decode (llama.cpp's decode path):
// REQUEST {"ids": prompt, "n_predict": 32, "top_k": 5, "threads": 2}; top[i] is the
// distribution that chose tokens[i].
static int cmd_greedy(const char * model_path, const char * request_path) {
    json req = json::parse(read_file(request_path));
    std::vector<llama_token> ids = req["ids"].get<std::vector<llama_token>>();
    const int n_predict = req.value("n_predict", 32);
    const int k = req.value("top_k", 5);
    const int threads = req.value("threads", 2);
    llama_model * model = load(model_path);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (ids.size() + n_predict + 16);
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = 512;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch batch = llama_batch_init((int32_t) cp.n_ctx, 0, 1);
    auto submit = [&](const std::vector<llama_token> & toks, size_t first_pos) {
        batch.n_tokens = 0;
        for (size_t i = 0; i < toks.size(); i++) {
            const int j = batch.n_tokens++;
            batch.token[j] = toks[i];
            batch.pos[j] = (llama_pos) (first_pos + i);
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = i + 1 == toks.size();
        }
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "decode failed\n");
            exit(1);
        }
    };
    submit(ids, 0);
    json tokens = json::array(), top = json::array();
    size_t pos = ids.size();
    for (int step = 0; step < n_predict; step++) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        json t = top_k(logits, n_vocab, k);
        const llama_token next = t[0][0].get<llama_token>();
        tokens.push_back(next);
        top.push_back(t);
        submit({next}, pos++);
    }
    std::cout << json{{"tokens", tokens}, {"top", top}}.dump() << "\n";
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

static std::string apply(const char * tmpl, const std::vector<llama_chat_message> & msgs, bool add_ass) {
    std::vector<char> buf(1 << 16);
    int n = llama_chat_apply_template(tmpl, msgs.data(), msgs.size(), add_ass, buf.data(), (int) buf.size());
    if (n < 0 || n > (int) buf.size()) {
        fprintf(stderr, "template %s failed (%d)\n", tmpl, n);
        exit(1);
    }
    return std::string(buf.data(), n);
}

static int cmd_chat(const char * tmpl, const char * messages_path) {
    json conv = json::parse(read_file(messages_path));
    std::vector<std::string> roles, contents;
    for (auto & m : conv) {
        roles.push_back(m["role"].get<std::string>());
        contents.push_back(m["content"].get<std::string>());
    }
    std::vector<llama_chat_message> msgs;
    for (size_t i = 0; i < roles.size(); i++) msgs.push_back({roles[i].c_str(), contents[i].c_str()});
    json out = {{"with_prompt", apply(tmpl, msgs, true)}, {"without", apply(tmpl, msgs, false)}};
    std::cout << out.dump() << "\n";
    return 0;
}

int main(int argc, char ** argv) {
    llama_backend_init();
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
    }, nullptr);
    std::string cmd = argc > 1 ? argv[1] : "";
    int rc = 2;
    if (cmd == "tokenize" && argc == 4) rc = cmd_tokenize(argv[2], argv[3]);
    else if (cmd == "logits" && argc == 4) rc = cmd_logits(argv[2], argv[3]);
    else if (cmd == "chat" && argc == 4) rc = cmd_chat(argv[2], argv[3]);
    else if (cmd == "greedy" && argc == 4) rc = cmd_greedy(argv[2], argv[3]);
    else fprintf(stderr, "usage: llamacpp_ref tokenize MODEL TEXT | logits MODEL REQUEST.json | greedy MODEL REQUEST.json | chat TEMPLATE MESSAGES.json\n");
    llama_backend_free();
    return rc;
}
