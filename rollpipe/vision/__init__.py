"""Images for vision-language agents: the image conversation, image-token checks, image
rows' 3-D positions, torchvision on CPU.

Importing this package installs the torchvision guard (``_torchvision.install``): on a
CPU torch with a CUDA torchvision wheel, torchvision's two operator-registration modules
are skipped so that it imports; ``write_torchvision_pth()`` installs it in every
interpreter of the environment. ``checks`` catches the prompts and responses vLLM would
silently corrupt; the tiny VLM the tests run on is training material, built with the tiny
text model (``rollpipe.training.tiny_vlm``). The engines carry images themselves
(``engine.generate(..., images=...)``).

Importing this package also registers the image conversation
(``rollpipe.vision.conversation``) with the episode, after the guard is installed, so
an env whose observations hold images needs nothing more than ``import rollpipe.vision``
(the visual envs import it themselves).
"""

from __future__ import annotations

from rollpipe.vision import _torchvision

__all__ = ["write_torchvision_pth"]

_torchvision.install()
write_torchvision_pth = _torchvision.write_pth
"""Write the .pth line that installs the guard in every interpreter of this environment
(vLLM's engine-core processes, Ray workers, a vLLM server); returns its path."""

from rollpipe.vision import conversation as _conversation  # noqa: E402  (after the guard)

del _conversation  # imported for its registration with the episode
