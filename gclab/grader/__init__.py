"""The grader an instructor runs: `gclab release` and `gclab grade`, and what decides a grade.

It uses the learner's instruments (`gclab.memory`, `gclab.checks`, ...) and is never imported by them (but for
the imports of `guard` marked TODO(lead), which go when guard.py is trimmed: tests/test_layout.py lists them).

- `grading`      the `gclab grade` and `gclab release` commands; `grade_one`, what decides a grade, step by step
- `launch`       a verdict process: the job handed to it, started (forked from a zygote) and read
- `verdict`      that process: runs the learner's code and the hidden tests, and reports; it never decides
- `guard`, `pinning`   keep the verdict's own state out of the learner's code's reach
- `measured`     what decides a point: the grader's own readings of the verdict process, compared with
                 the reference solution's under the same conditions
- `tampering`, `review`   what in an answer rebinds the course's tools, or reads what tells a grading
                 run from the learner's own
- `cells`, `results`   a notebook's cells as the grader reads them; what grading returns
- `classroom`, `cluster`, `gradebook`, `feedback`, `report`   a class: its submissions graded here or on
                 a Dask cluster, the nbgrader gradebook, feedback handed back, the class report
- `preprocessors`, `_nbgrader_job`   nbgrader's side: its Autograde button grades with the course's verdict
- `course`       where the course lives (Colab), its kernel, and the set-up cell the release writes
"""
