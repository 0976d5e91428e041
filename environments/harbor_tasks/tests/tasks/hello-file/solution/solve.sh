#!/bin/bash
echo Hello > /app/hello.txt
