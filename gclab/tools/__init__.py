"""The course's own tools, for whoever maintains it: `gclab bench` (`bench`: times the lessons, their
grading and the meter's overhead) and `gclab gpu-check` (`gpucheck`: runs and grades every lesson on a
CUDA GPU and on the CPU and compares).  Neither is imported by a lesson nor by the grader."""
