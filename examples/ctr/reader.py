"""PaddleRec Criteo lines on stdin -> MultiSlot text on stdout: the ``pipe_command`` of a dataset
over ``examples/ctr/gen_slot_files.py --format paddlerec`` files::

    dataset.init(batch_size=512, thread_num=2, use_var=examples.ctr.slots.make_slots(),
                 pipe_command="python examples/ctr/reader.py")

A Paddle data generator: the same file runs under PaddlePaddle by changing only the import line
(``bench/check_reader_compat.py`` does exactly that and compares the bytes).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fleet.data as dg  # Paddle: import paddle.distributed.fleet as dg
from examples.ctr.slots import parse_paddlerec_line


class CriteoSlotReader(dg.MultiSlotDataGenerator):
    """One MultiSlot example per PaddleRec line: ``click``, ``1`` .. ``26``, ``dense_feature``."""

    def generate_sample(self, line):
        def reader():
            yield parse_paddlerec_line(line)

        return reader


if __name__ == "__main__":
    CriteoSlotReader().run_from_stdin()
