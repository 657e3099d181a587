package idempotency

import "testing"

// The large-object API of a call's transaction depends on pgx's
// LargeObjects holding nothing but its Tx (see largeObjectsOf).
func TestUnitLargeObjectsLayout(t *testing.T) {
	if !largeObjectsLayout {
		t.Fatal("pgx.LargeObjects is no longer a struct of one pgx.Tx: update largeObjectsOf")
	}
}
