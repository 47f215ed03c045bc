"""Training data and the latent format: the embedded digits, latent shards (reader `shards`, writer
`shard_writer`, images -> shards `extract_latents`, MaskDiT's release -> shards `maskdit_latents`), the SD-VAE
(`vae`), latents -> images (`decoders`, `images`) and a resumable sampler.

Every dataset is map-style and addressed by a *global* index `epoch * N + i`, so any randomness a
dataset draws for a read (a posterior sample, a flip) is a function of that index alone: a resumed
run sees exactly the batches an uninterrupted one would, whatever the number of loader workers.
"""
from data.batch_sampler import ResumableBatchSampler, check_holds_one_batch
from data.digits import DigitsDataset
from data.shards import LatentShardDataset
from tread_utils.distributed import available_cores

# dataset.kind -> the training dataset for a `dataset` config
DATASETS = {
    "digits": lambda d, seed, images: DigitsDataset("train", resolution=d.input_size),
    "shards": lambda d, seed, images: LatentShardDataset(
        d.train_path, in_channels=d.in_channels, input_size=d.input_size, num_classes=d.num_classes,
        scale_factor=d.get("scale_factor"), random_flip=d.get("random_flip", False),
        posterior_sampling=d.get("posterior_sampling", False), seed=seed, with_images=images),
}


def build_dataset(dataset_cfg, seed: int = 0, teacher_images: bool = False, global_batch: int = 0):
    """The training dataset named by the `dataset` config group. `teacher_images`: latent samples also carry
    their clean image (REPA's teacher); the digits are their own images, so it changes nothing there.
    Building it reads what can be checked without training (the shards' headers, their layout, manifest.json,
    the images REPA needs): a bad dataset is a UserError here, as is one holding fewer samples than one
    `global_batch` (samples per optimizer micro-step over all processes; 0: not checked)."""
    dataset = DATASETS[dataset_cfg.kind](dataset_cfg, seed, teacher_images)  # the kind: checked by the schema's rule
    check_holds_one_batch(len(dataset), global_batch)
    return dataset


def loader_workers(requested: int) -> tuple:
    """(DataLoader workers per process, a note or ''): `requested` capped at the cores this process may use,
    the most torch's DataLoader accepts without a warning."""
    cores = available_cores()
    if requested <= cores:
        return requested, ""
    return cores, f"data loader: {cores} worker(s) per process, the cores available (train.general.num_workers={requested})"


__all__ = ["DATASETS", "DigitsDataset", "LatentShardDataset", "ResumableBatchSampler", "build_dataset",
           "loader_workers"]
