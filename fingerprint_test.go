package idempotency

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestUnitFingerprint(t *testing.T) {
	t.Parallel()
	fp := func(method, body string) []byte {
		b, err := Fingerprint(method, wrapperspb.String(body))
		require.NoError(t, err)
		return b
	}
	require.Len(t, fp("/a/M", "x"), 32)
	require.Equal(t, fp("/a/M", "x"), fp("/a/M", "x"), "stable")
	require.NotEqual(t, fp("/a/M", "x"), fp("/a/M", "y"), "another body")
	require.NotEqual(t, fp("/a/M", "x"), fp("/a/N", "x"), "another method")
	// The method and the body are separated, so they cannot trade bytes.
	require.NotEqual(t, fp("/a/M", "\x0a\x01x"), fp("/a/M\x0a", "\x01x"))
}
