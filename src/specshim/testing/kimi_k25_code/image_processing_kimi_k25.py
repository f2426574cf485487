"""A minimal media processor for the tiny Kimi-K2.5 checkpoint.

vLLM's Kimi-K2.5 processing info loads the checkpoint's image processor even
for text-only use, and its profiling dummies call ``media_tokens_calculator``
and ``num_frames_per_chunk``. This one resizes every image or video frame to a
fixed ``side`` x ``side`` square and cuts it into ``patch_size`` patches, which
is all MoonViT needs: ``pixel_values`` ``[patches, 3, p, p]`` plus one
``grid_thws`` row ``[frames, h, w]`` per item.
"""

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


class TinyKimiK25ImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(
        self,
        patch_size=14,
        merge_kernel_size=(2, 2),
        side=56,
        num_frames_per_chunk=4,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.merge_kernel_size = list(merge_kernel_size)
        self.side = side
        self.num_frames_per_chunk = num_frames_per_chunk

    def _frames(self, item):
        if item["type"] == "image":
            return [item["image"]]
        return list(item["video_chunk"])

    def media_tokens_calculator(self, item):
        grid = self.side // self.patch_size
        merge_h, merge_w = self.merge_kernel_size
        # Frames of a chunk are pooled over time into one set of tokens.
        return (grid // merge_h) * (grid // merge_w)

    def split_video_chunks(self, video):
        step = self.num_frames_per_chunk
        return [
            {"type": "video_chunk", "video_chunk": video[i : i + step]}
            for i in range(0, len(video), step)
        ]

    def _patches(self, frame):
        image = frame if isinstance(frame, Image.Image) else Image.fromarray(frame)
        image = image.convert("RGB").resize((self.side, self.side))
        array = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
        p, grid = self.patch_size, self.side // self.patch_size
        array = array.permute(2, 0, 1).reshape(3, grid, p, grid, p)
        return array.permute(1, 3, 0, 2, 4).reshape(grid * grid, 3, p, p)

    def preprocess(self, vision_chunks, **kwargs):
        pixel_values, grid_thws = [], []
        grid = self.side // self.patch_size
        for item in vision_chunks:
            frames = self._frames(item)
            pixel_values += [self._patches(frame) for frame in frames]
            grid_thws.append([len(frames), grid, grid])
        return BatchFeature(
            {
                "pixel_values": torch.cat(pixel_values),
                "grid_thws": torch.tensor(grid_thws),
            }
        )
