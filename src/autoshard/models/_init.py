"""The one weight initialization the reference models share."""

from torch import nn


def init_weights(model: nn.Module) -> None:
    """Draw linear, embedding and experts' weights from normal(0, 0.02) and zero linear
    biases.

    Draws come from the ambient generator, so ``torch.manual_seed`` fixes them. Norm weights keep
    the ones (and biases the zeros) their constructors give them. On the meta device the draws are
    no-ops, which is what lets the models be built there.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if hasattr(module, "experts_activation"):  # experts: [E, 2F, H] and [E, H, F]
            nn.init.normal_(module.gate_up_proj, std=0.02)
            nn.init.normal_(module.down_proj, std=0.02)
