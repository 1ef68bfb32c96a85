"""A data generator written for PaddlePaddle, with only its import changed (the Paddle line is
kept as a comment): CSV lines ``label,id;id;...,f1;f2`` -> MultiSlot text. Used as the
``pipe_command`` of fleet.data tests (``python tests/scripts/data_reader.py``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# import paddle.distributed.fleet as dg
import fleet.data as dg


class CsvReader(dg.MultiSlotDataGenerator):
    def generate_sample(self, line):
        def local_iter():
            label, ids, dense = line.strip().split(",")
            if label == "skip":  # a None sample is dropped, as in Paddle
                yield None
                return
            yield [
                ("label", [int(label)]),
                ("ids", [int(x) for x in ids.split(";")] if ids else [0]),
                ("dense", [float(x) for x in dense.split(";")]),
            ]

        return local_iter


if __name__ == "__main__":
    CsvReader().run_from_stdin()
