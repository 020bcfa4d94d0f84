"""`python -m gclab.serving serve|load ARGV...`: a model server or a load generator (gclab.serving.processes)."""
import sys

import gclab.serving

sys.modules["__main__"] = gclab.serving        # the server's module, as a policy finds it, forked or not
sys.exit(gclab.serving.main())
