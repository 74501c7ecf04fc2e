#!/bin/sh
# Package scripts must not start services inside an image build.
exit 101
