"""adaLN conditioning shared by every block family: x * (1 + scale) + shift, per sample."""


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
