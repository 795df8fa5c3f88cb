"""MATTRL experience construction and pool lifecycle (paper 003, sections 3.2 and 5): reading labelled runs, judge
scores, credit assignment, distillation into pool entries, pruning, and the adaptive router of section 5.2."""
