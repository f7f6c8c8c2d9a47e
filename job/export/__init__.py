"""Hand-off to the trainers: a run's hidden states and completions in the formats SpecForge and vLLM speculators read.

    python -m job export RUN --to specforge --format dflash --output DIR [--layers 1 2]
    python -m job export RUN --to specforge --format eagle3 --output DIR [--draft-vocab-size 32000]
    python -m job export RUN --to speculators --format eagle3 --output DIR      # needs last_layer_before_norm
    python -m job export RUN --to specforge --format conversations --output DIR

    from job.export import export, stream
    export("run", to="specforge", format="eagle3", output="out")     # files, as above
    ds = stream(config, to="speculators", format="dflash")          # ray.data, never written (see `collate`)

Formats matched, read from the projects' own code (neither installs here: SpecForge 0.2.0 pins torch 2.11 and
sglang; speculators 0.9.0 needs `datasets`, which the shared venv lacks):
- SpecForge 0.2.0 (PyPI wheel; repository sgl-project/SpecForge at a6b6b023, version.txt 0.2.0). Writer:
  scripts/prepare_hidden_states.py (`HiddenStatesGenerator`: `rows_{g}-{g+2000}/data_{i}.ckpt`, one `torch.save`
  dict per sample; vocab mapping at `vocab_mapping/vocab_mapping.pt`). Keys: `OfflineCaptureLayout` of
  specforge/algorithms/{dflash,eagle3}/providers.py. Reader: runtime/data_plane/offline_reader.py
  (`list_feature_files`) + feature_store.py (`load_feature_file`) + the normalizers in
  algorithms/common/dflash_family_data.py and algorithms/eagle3/data.py. Vocab mapping:
  data/preprocessing.py (`generate_vocab_mapping_file`, `process_token_dict_to_mappings`). Conversations:
  scripts/regenerate_train_data.py (row shape) and scripts/validate_regenerated_data.py +
  conversation_validation.py (the rules applied here).
- speculators 0.9.0 (PyPI wheel) with hs-connectors 0.9.0: train/data.py (`ArrowDataset`: `load_from_disk`,
  `hs_{i}.safetensors` through hs_connectors' `FileTransfer`, token ids checked against `input_ids`, last layer
  split off as `verifier_last_hidden_states`), data_generation/preprocessing.py (columns input_ids, loss_mask,
  seq_len; `set_format("torch")` before `save_to_disk`), train/vocab_mapping.py (`token_freq.pt`).

Layer conventions (docs/ARCHITECTURE.md, "One run, every trainer"; job/drafters.py): ours, k = output of decoder
layer k = transformers output_hidden_states[k + 1], is SpecForge's too (DFlash `extract_context_feature` reads
hidden_states[layer_id + 1]; EAGLE-3 captures the input of layer id + 1 in SGLang). vLLM and speculators count one
higher (id = ours + 1; speculators' dflash converter maps `i + 1`), and their last slot is the final decoder layer
BEFORE the final norm: what a run stores by default (`hidden_states.last_layer_before_norm: true`). SpecForge's
EAGLE-3 `hidden_state` is the last layer AFTER the norm (its trainer feeds it to the target's LM head): the export
applies the target's final norm to the stored layer (export/norm.py). A run that stored it after the norm (`false`)
exports to SpecForge only: an export to speculators from it stops.

Every export writes `export.json` (conventions, layer ids in the trainer's terms, counts, dropped by reason),
`samples.jsonl` (trainer index → our id) and `dropped.jsonl` (id, reason) beside the trainer's files.

Modules: stage.py (`export`: the export as a stage of the run, its work on the cluster's workers), files.py (the
trainers' files: counting, writing, finishing), trainer_format.py (layer plan, one sample's tensors, drops,
vocabulary statistics, the bookkeeping files), conversations.py (SpecForge's conversations JSONL), stream.py
(`stream`).
"""

from job.export.conversations import export_conversations
from job.export.stage import export
from job.export.stream import stream
from job.export.trainer_format import TARGETS, ExportError, Plan, make_plan
from job.hidden_states import collate  # one collate for both streams

__all__ = ["export", "export_conversations", "stream", "collate", "make_plan", "Plan", "ExportError", "TARGETS"]
