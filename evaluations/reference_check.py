"""Whether a FID is worth reading: the reference and the samples went through the same feature network, and
there are more samples than feature dimensions. One set of rules for `fid.py calc`, the evaluator
(evaluations/evaluator.py) and the in-training FID.

`fid.py ref` tags its reference with the network that made it (`feature_network`: inception, digits, or
inception-random-init); a reference without the tag (ADM's batches) is not checked.
With N samples of D-dimensional features the covariance has rank at most N - 1: for N <= D it is singular
and the FID depends more on N than on the images (16 random-network samples give about 20).
"""
import numpy as np

from tread_utils.errors import UserError

TAG_KEY = "feature_network"
SIZE_KEY = "image_size"  # [H, W] of the images `fid.py ref` made its statistics from
RANDOM_SUFFIX = "-random-init"


def network_tag(name: str, random_init: bool = False) -> str:
    return name + (RANDOM_SUFFIX if random_init else "")


def stored_tag(ref_path):
    """The `feature_network` tag of a reference .npz, or None (untagged: ADM's files)."""
    try:
        with np.load(ref_path, allow_pickle=False) as npz:
            return str(npz[TAG_KEY]) if TAG_KEY in npz.files else None
    except (OSError, ValueError, EOFError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{ref_path} cannot be read as a reference .npz ({reason}); make one with "
                        f"`python fid.py ref --images DIR --out REF.npz`") from None


def check_image_size(ref_path, sample_shape, what: str = "samples"):
    """Refuse samples of another size than the reference's images (its `arr_0`, or the size `fid.py ref`
    stored): the FID would measure the resize, not the model. A reference that tells no size is not checked."""
    with np.load(ref_path, allow_pickle=False) as npz:
        if "arr_0" in npz.files:
            with npz.zip.open("arr_0.npy") as f:  # the header alone: ADM's batches hold 10,000 images
                fmt = np.lib.format
                header = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
                size = tuple(header(f)[0][1:3])
        else:
            size = tuple(int(v) for v in npz[SIZE_KEY]) if SIZE_KEY in npz.files else None
    if size is not None and size != tuple(sample_shape[1:3]):
        raise UserError(f"{ref_path} is a reference of {size[0]}x{size[1]} images, the {what} are "
                        f"{sample_shape[1]}x{sample_shape[2]}: the FID would compare sizes, not models; score them "
                        f"against a reference of their own size (python fid.py ref --images DIR --out REF.npz)")


def split_tag(tag: str):
    """(network name, random_init) of a tag."""
    return (tag[:-len(RANDOM_SUFFIX)], True) if tag.endswith(RANDOM_SUFFIX) else (tag, False)


def check_reference_network(ref_path, tag: str, fix):
    """Refuse a reference tagged with another network than `tag`; `fix(stored tag)` (or a string) says how,
    in the calling command's spelling."""
    stored = stored_tag(ref_path)
    if stored is not None and stored != tag:
        raise UserError(f"{ref_path} was made with the feature network {stored}, but this scores with {tag}: "
                        f"the FID would compare different features; {fix(stored) if callable(fix) else fix}")


def few_samples_warning(count: int, dims: int, what: str = "samples"):
    """A warning line when `count` feature vectors of `dims` dimensions give a singular covariance, else None."""
    if count > dims:
        return None
    return (f"FID from {count} {what} with {dims}-dimensional features: the covariance is singular (rank at most "
            f"{count - 1}), so the FID means little; use more than {dims} (ADM: 50,000 samples)")
