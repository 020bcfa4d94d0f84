"""The grader an instructor runs: `gclab release` and `gclab grade`, and what decides a grade.

It uses the learner's instruments (`gclab.memory`, `gclab.checks`, ...) and is never imported by them.

- `grading`      the `gclab grade` and `gclab release` commands: a verdict process per notebook, its
                 results confirmed by the grader's own measurements
- `verdict`      the verdict process, forked from a zygote: runs the learner's code and the hidden tests
- `guard`, `pinning`   keep the verdict's own state out of the learner's code's reach
- `measured`     what decides a point: the grader's own readings of the verdict process, compared with
                 the reference solution's under the same conditions
- `tampering`, `review`   what in an answer rebinds the course's tools, or reads what tells a grading
                 run from the learner's own
- `classroom`, `cluster`, `gradebook`, `feedback`, `report`   a class: its submissions graded here or on
                 a Dask cluster, the nbgrader gradebook, feedback handed back, the class report
- `preprocessors`, `_nbgrader_job`   nbgrader's side: its Autograde button grades with the course's verdict
- `course`       where the course lives (Colab), its kernel, and the set-up cell the release writes
"""
