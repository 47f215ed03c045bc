"""The batch sampler that makes resume exact: step s always maps to the same samples."""
import torch

from tread_utils.errors import UserError


def check_holds_one_batch(num_samples: int, global_batch: int):
    """Each step draws `global_batch` samples (all processes' micro-batches) without repeats."""
    if num_samples < global_batch:
        raise UserError(f"the dataset holds {num_samples} samples, fewer than one global batch of "
                        f"{global_batch}; lower train.general.batch_size")


class ResumableBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's batches of global indices from `start_step` on, forever.

    Epoch e is a permutation seeded by (seed, e); each step takes the next `batch_size * world_size`
    indices of it and this rank takes its slice, dropping the incomplete tail. Step s therefore
    always maps to the same samples, which is all a checkpoint needs to store the data position.

    Resuming under another number of processes: with the same global batch (`batch_size * world_size`),
    step s draws the same set of samples whatever `world_size` is; only which rank gets which of them
    changes (tests/test_batch_sampler.py). With another global batch, steps map to other samples.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 start_step: int = 0):
        global_batch = batch_size * world_size
        check_holds_one_batch(num_samples, global_batch)
        self.num_samples, self.batch_size, self.rank, self.world_size = num_samples, batch_size, rank, world_size
        self.seed, self.start_step = seed, start_step
        self.steps_per_epoch = num_samples // global_batch

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self):
        step = self.start_step
        epoch, perm = None, None
        while True:
            e, k = divmod(step, self.steps_per_epoch)
            if e != epoch:
                epoch, perm = e, self.epoch_permutation(e)
            begin = (k * self.world_size + self.rank) * self.batch_size
            yield (perm[begin:begin + self.batch_size] + epoch * self.num_samples).tolist()
            step += 1

    def __len__(self):  # infinite in principle; a large number keeps DataLoader happy
        return 2 ** 62
