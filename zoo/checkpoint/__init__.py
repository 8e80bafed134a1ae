"""Sharded safetensors checkpoints in the Hugging Face layout, from and into any plan.

    save(model, path, *, max_shard_size="5GB", optimizer=None, scheduler=None, state=None, tokenizer=None,
         config_fields=None, generation_config=None) -> Path
    load(model, path, *, strict=True, verify=False) -> {"missing", "unexpected", "mismatched"}
    load_training_state(path, model, optimizer=None, scheduler=None, *, rng=True) -> dict
    verify(path, *, require_checksums=True) -> {"path", "files", "tensors", "bytes"}
    convert(src, dst, *, max_shard_size=None, dtype=None, progress=True, overwrite=False) -> Path

On disk (``transformers.AutoModel*.from_pretrained(path)`` loads the model part)::

    path/
      config.json                          HF config (torch_dtype = the parameters' dtype)
      model-00001-of-0000N.safetensors     model tensors under HF names, tied weights once
      ...
      model.safetensors.index.json         weight_map; metadata: total_size, files (size +
                                           SHA-256 of every other file, + the header's
                                           SHA-256 of each shard): the commit file,
                                           written last
      (or model.safetensors alone when it fits: its header metadata "cuboid" holds the
       SHA-256 of its data section, of its header, and the records of the other files)
      optimizer-0000i-of-0000M.safetensors full optimizer state per zoo parameter name
      optimizer.safetensors.index.json     + param groups, per-param steps, class
      trainer_state.json                   step, scheduler, RNG of every rank, caller's
                                           state (data position), plan, config, world size

Modules: :mod:`.shards` (which tensor in which file, from shapes only, on
``huggingface_hub``'s splitter), :mod:`.format` (streaming safetensors writer,
byte checks), :mod:`.writer` (the save loop: rank 0 writes everything, every
rank gathers every tensor in the same order; ``zoo.to_hf`` writes through it
too), :mod:`.stages` (pipeline-parallel models: each stage writes its own
files into the same folder, rank 0 the index last; loads skip the tensors of
other stages' layers), :mod:`.folder` (the atomic replace protocol and what a crash leaves),
:mod:`.reader` (validation, verify, and the one folder reader: ``load`` here,
``cuboid.load(folder)`` / ``zoo.from_hf`` through ``read_new``, both reading
only each rank's ``shard_slices`` from the memory-mapped files), :mod:`.state`
(optimizer, RNG, training state as a save records them), :mod:`.resume`
(reading them back), :mod:`.convert`, :mod:`.adapters` (a LoRA model's adapters in
``peft``'s layout: what ``save`` writes for one), :mod:`.precheck` (a folder's config.json against
its weight map, before ``cuboid.load(folder)`` builds anything), :mod:`.lora_state` (a LoRA run's
checkpoint: adapters, optimizer state by name and training state as safetensors + JSON under their own commit
file, ``lora-checkpoint.json``, which ``verify`` reads). The reader and the writer never import
each other: what both need (file names, records, errors) is in :mod:`.format`,
the shard plan in :mod:`.shards`, the stage rule in :mod:`.stages`.

Checkpoint code reaches parameters only through the layers' full-tensor
interface (``full_shape``, ``shard_slices``, ``full_tensor``, ``load_full``;
``full_tensor_like`` for sharded optimizer state), so the tensor modes plug
in without changes here; pipeline stages only add who writes which file
(:mod:`.stages`).
"""
from .convert import convert
from .folder import resolve
from .format import CheckpointError
from .reader import TensorFolder, load, verify as verify_folder
from .resume import load_training_state
from .writer import save as save_model

__all__ = ["save", "load", "load_training_state", "verify", "convert", "resolve", "CheckpointError",
           "TensorFolder"]


def save(model, path, *, max_shard_size="5GB", optimizer=None, scheduler=None, state=None, tokenizer=None,
         config_fields=None, generation_config=None):
    """:func:`.writer.save` (its docstring says what is written); a LoRA model's adapters (and ``tokenizer``)
    as a peft folder under its commit file (:func:`.lora_state.save_adapters`)."""
    from .adapters import has_adapters

    if has_adapters(model):
        if optimizer is not None or scheduler is not None or state is not None:
            raise CheckpointError("a LoRA model's optimizer, scheduler and state are saved by "
                                  "cuboid.zoo.lora.save_checkpoint(model, path, optimizer=..., ...)")
        from .lora_state import save_adapters

        return save_adapters(model, path, tokenizer=tokenizer)
    return save_model(model, path, max_shard_size=max_shard_size, optimizer=optimizer, scheduler=scheduler,
                      state=state, tokenizer=tokenizer, config_fields=config_fields,
                      generation_config=generation_config)


def verify(path, *, require_checksums: bool = True) -> dict:
    """Check every file of a checkpoint against its recorded size and SHA-256 (:func:`.reader.verify`); a LoRA
    training checkpoint or adapter folder against its own commit file (:func:`.lora_state.verify_lora`)."""
    from .format import lora_commit
    from .lora_state import verify_lora

    if lora_commit(resolve(path)) is not None:
        return verify_lora(path)
    return verify_folder(path, require_checksums=require_checksums)
